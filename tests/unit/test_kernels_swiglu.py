"""Fused SwiGLU on interleaved (gate, up) pairs against a float64 formula (every backend) and the model's
``swiglu`` (the compiled backends; the fallback is that function)."""

from __future__ import annotations

import pytest
import torch

from megatron_like.kernels import fused_swiglu
from megatron_like.model.transformer import swiglu
from tests.unit._kernel_backends import backend, compiled  # noqa: F401 - fixture

pytestmark = pytest.mark.usefixtures("backend")

# Per dtype: tolerance against the float64 formula of the same (rounded) inputs. 16-bit results carry the
# contract's two roundings (silu, then the product); the gradient a few more.
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (2e-3, 2e-3)}


def swiglu_float64(gate_up: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return float64 ``(y, dgate_up)`` of ``gate * sigmoid(gate) * up``, written independently of the kernels."""
    leaf = gate_up.detach().double().requires_grad_()
    gate, up = leaf[..., 0::2], leaf[..., 1::2]
    y = gate * torch.sigmoid(gate) * up
    y.backward(dy.double())
    return y.detach(), leaf.grad


def assert_matches_float64(y: torch.Tensor, dgate_up: torch.Tensor, gate_up: torch.Tensor, dy: torch.Tensor,
                           dtype: torch.dtype) -> None:
    rtol, atol = TOL[dtype]
    ref, dref = swiglu_float64(gate_up, dy)
    torch.testing.assert_close(y.double(), ref, rtol=rtol, atol=atol)
    torch.testing.assert_close(dgate_up.double(), dref, rtol=rtol, atol=atol)


@pytest.mark.parametrize("shape", [(3, 4, 2 * 40), (7, 2), (2, 2 * 129)])
def test_swiglu_matches_float64_reference(shape):
    gen = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(shape, generator=gen) * 4).requires_grad_()
    dy = torch.randn(*shape[:-1], shape[-1] // 2, generator=gen)
    y = fused_swiglu(gate_up)
    y.backward(dy)
    assert_matches_float64(y, gate_up.grad, gate_up, dy, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_swiglu_every_dtype_matches_float64_and_the_model(dtype, backend):  # noqa: F811 - the fixture, for its name
    gen = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(5, 3, 2 * 72, generator=gen) * 3).to(dtype).requires_grad_()
    dy = torch.randn(5, 3, 72, generator=gen).to(dtype)
    y = fused_swiglu(gate_up)
    y.backward(dy)
    assert y.dtype == gate_up.grad.dtype == dtype
    assert_matches_float64(y, gate_up.grad, gate_up, dy, dtype)
    if compiled(backend):  # the fallback is the model's swiglu itself: comparing them would prove nothing
        ref_in = gate_up.detach().clone().requires_grad_()
        ref = swiglu(ref_in)
        ref.backward(dy)
        rtol, atol = TOL[dtype]
        torch.testing.assert_close(y, ref, rtol=rtol, atol=atol)
        torch.testing.assert_close(gate_up.grad, ref_in.grad, rtol=rtol, atol=atol)


def test_swiglu_extreme_gates_saturate():
    gate = torch.tensor([-1e4, -100.0, -20.0, -1e-6, 0.0, 1e-6, 20.0, 100.0, 1e4])
    gate_up = torch.stack([gate, torch.full_like(gate, 2.0)], dim=-1).reshape(1, -1).requires_grad_()
    y = fused_swiglu(gate_up)
    y.sum().backward()
    ref, dref = swiglu_float64(gate_up, torch.ones_like(y))
    torch.testing.assert_close(y.double(), ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gate_up.grad.double(), dref, rtol=1e-6, atol=1e-6)


def test_swiglu_strided_input():
    gen = torch.Generator().manual_seed(2)
    leaf = torch.randn(8, 6, generator=gen).requires_grad_()
    gate_up = leaf.t()  # [6, 8] with strides (1, 6)
    dy = torch.randn(6, 4, generator=gen)
    y = fused_swiglu(gate_up)
    y.backward(dy)
    ref, dref = swiglu_float64(gate_up, dy)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(leaf.grad.double(), dref.t(), rtol=1e-5, atol=1e-6)


def test_swiglu_gradcheck_float64():
    gate_up = torch.randn(3, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(3), requires_grad=True)
    assert torch.autograd.gradcheck(fused_swiglu, (gate_up,))


def test_swiglu_rejects_odd_width():
    with pytest.raises(ValueError, match="even"):
        fused_swiglu(torch.randn(2, 5))
