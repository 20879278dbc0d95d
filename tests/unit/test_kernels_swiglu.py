"""Fused SwiGLU on interleaved (gate, up) pairs against the model's reference ``swiglu``, on every backend."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_like.kernels import fused_swiglu
from megatron_like.model.transformer import swiglu
from tests.unit._kernel_backends import backend  # noqa: F401 - fixture

pytestmark = pytest.mark.usefixtures("backend")

TOL = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (2e-3, 2e-3)}


@pytest.mark.parametrize("shape", [(3, 4, 2 * 40), (7, 2), (2, 2 * 129)])
def test_swiglu_matches_float64_reference(shape):
    gen = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(shape, generator=gen) * 4).requires_grad_()
    dy = torch.randn(*shape[:-1], shape[-1] // 2, generator=gen)
    y = fused_swiglu(gate_up)
    y.backward(dy)
    ref_in = gate_up.detach().double().requires_grad_()
    gate, up = ref_in[..., 0::2], ref_in[..., 1::2]  # interleaved pairs, written independently of swiglu()
    ref = gate * torch.sigmoid(gate) * up
    ref.backward(dy.double())
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gate_up.grad.double(), ref_in.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_swiglu_matches_model_reference(dtype, backend):  # noqa: F811 - the fixture, for its name
    gen = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(5, 3, 2 * 72, generator=gen) * 3).to(dtype).requires_grad_()
    dy = torch.randn(5, 3, 72, generator=gen).to(dtype)
    y = fused_swiglu(gate_up)
    y.backward(dy)
    assert y.dtype == gate_up.grad.dtype == dtype
    ref_in = gate_up.detach().clone().requires_grad_()
    ref = swiglu(ref_in)
    ref.backward(dy)
    rtol, atol = (0, 0) if backend == "fallback" else TOL[dtype]  # the fallback runs the reference's ops
    torch.testing.assert_close(y, ref, rtol=rtol, atol=atol)
    torch.testing.assert_close(gate_up.grad, ref_in.grad, rtol=rtol, atol=atol)


def test_swiglu_extreme_gates_saturate():
    gate = torch.tensor([-1e4, -100.0, -20.0, -1e-6, 0.0, 1e-6, 20.0, 100.0, 1e4])
    gate_up = torch.stack([gate, torch.full_like(gate, 2.0)], dim=-1).reshape(1, -1).requires_grad_()
    y = fused_swiglu(gate_up)
    y.sum().backward()
    ref_in = gate_up.detach().double().requires_grad_()
    swiglu(ref_in).sum().backward()
    torch.testing.assert_close(y.double(), F.silu(gate.double()).unsqueeze(0) * 2, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gate_up.grad.double(), ref_in.grad, rtol=1e-6, atol=1e-6)


def test_swiglu_strided_input():
    gen = torch.Generator().manual_seed(2)
    leaf = torch.randn(8, 6, generator=gen).requires_grad_()
    fused_swiglu(leaf.t()).square().sum().backward()  # [6, 8] with strides (1, 6)
    ref_leaf = leaf.detach().clone().requires_grad_()
    swiglu(ref_leaf.t()).square().sum().backward()
    torch.testing.assert_close(leaf.grad, ref_leaf.grad, rtol=1e-5, atol=1e-6)


def test_swiglu_gradcheck_float64():
    gate_up = torch.randn(3, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(3), requires_grad=True)
    assert torch.autograd.gradcheck(fused_swiglu, (gate_up,))


def test_swiglu_rejects_odd_width():
    with pytest.raises(ValueError, match="even"):
        fused_swiglu(torch.randn(2, 5))
