"""Fused RMSNorm against the model's reference ``rms_norm`` and a float64 reference, on every backend."""

from __future__ import annotations

import pytest
import torch

from megatron_like.kernels import fused_rms_norm
from megatron_like.model.norms import rms_norm
from tests.unit._kernel_backends import backend  # noqa: F401 - fixture

pytestmark = pytest.mark.usefixtures("backend")

# Per dtype: tolerance of the fused op against the reference computed in that same dtype (one rounding).
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (2e-3, 2e-3)}


def reference_grads(x, w, dy, eps, dtype):
    """Autograd of the model's rms_norm (in ``dtype``): returns (out, dx, dw)."""
    rx, rw = x.detach().to(dtype).requires_grad_(), w.detach().to(dtype).requires_grad_()
    out = rms_norm(rx, rw, eps)
    out.backward(dy.to(dtype))
    return out, rx.grad, rw.grad


@pytest.mark.parametrize("shape", [(3, 4, 32), (5, 37), (1, 3)])
def test_rms_norm_matches_float64_reference(shape):
    gen = torch.Generator().manual_seed(0)
    h = shape[-1]
    x = (torch.randn(shape, generator=gen) * 3 + 1).requires_grad_()
    w = torch.randn(h, generator=gen).requires_grad_()
    dy = torch.randn(shape, generator=gen)
    y = fused_rms_norm(x, w, 1e-5)
    y.backward(dy)
    # rms_norm in float64 computes its statistics in float32: write the float64 reference out instead.
    rx, rw = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = rx * torch.rsqrt(rx.pow(2).mean(-1, keepdim=True) + 1e-5) * rw
    ref.backward(dy.double())
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), rx.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), rw.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_matches_model_reference(dtype, backend):  # noqa: F811 - the fixture, for its name
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(6, 4, 96, generator=gen) * 2).to(dtype).requires_grad_()
    w = (1 + torch.randn(96, generator=gen) * 0.1).to(dtype).requires_grad_()
    dy = torch.randn(6, 4, 96, generator=gen).to(dtype)
    y = fused_rms_norm(x, w, 1e-6)
    y.backward(dy)
    assert y.dtype == x.grad.dtype == w.grad.dtype == dtype
    ref, rdx, rdw = reference_grads(x, w, dy, 1e-6, dtype)
    if backend == "fallback":  # the same ops as the reference: bit for bit
        tols = dict(rtol=0, atol=0)
    else:
        rtol, atol = TOL[dtype]
        tols = dict(rtol=rtol, atol=atol)
    torch.testing.assert_close(y, ref, **tols)
    torch.testing.assert_close(x.grad, rdx, **tols)
    # dw sums 24 rows: a few roundings of the reference's 16-bit products add up.
    scale = 1.0 if backend == "fallback" else 4.0
    torch.testing.assert_close(w.grad, rdw, rtol=tols["rtol"] * scale, atol=tols["atol"] * scale)


def test_rms_norm_weight_without_grad_and_strided_input():
    gen = torch.Generator().manual_seed(2)
    leaf = torch.randn(16, 5, generator=gen).requires_grad_()
    w = torch.randn(16, generator=gen)  # needs no gradient
    x = leaf.t()  # [5, 16] with strides (1, 5)
    assert not x.is_contiguous()
    y = fused_rms_norm(x, w, 1e-5)
    y.square().sum().backward()
    ref_leaf = leaf.detach().clone().requires_grad_()
    ref = rms_norm(ref_leaf.t(), w, 1e-5)
    ref.square().sum().backward()
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(leaf.grad, ref_leaf.grad, rtol=1e-5, atol=1e-5)
    assert w.grad is None


def test_rms_norm_gradcheck_float64():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 7, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(7, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: fused_rms_norm(a, b, 1e-5), (x, w))


def test_rms_norm_rejects_wrong_weight():
    with pytest.raises(ValueError, match="weight"):
        fused_rms_norm(torch.randn(2, 4), torch.randn(3), 1e-5)


def test_rms_norm_weight_grad_sums_the_rows_of_every_thread():
    """Two threads (rows split between them) must add their partial weight gradients."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(64, 1024, generator=gen).requires_grad_()  # enough work for two kernel threads
    w = torch.randn(1024, generator=gen).requires_grad_()
    dy = torch.randn(64, 1024, generator=gen)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        fused_rms_norm(x, w, 1e-5).backward(dy)
    finally:
        torch.set_num_threads(threads)
    rx, rw = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    rms_norm(rx, rw, 1e-5).backward(dy)
    torch.testing.assert_close(w.grad, rw.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(x.grad, rx.grad, rtol=1e-5, atol=1e-5)
