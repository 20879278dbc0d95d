"""Fused RMSNorm against a float64 formula (every backend) and the model's ``rms_norm`` (the compiled backends;
the fallback is that function)."""

from __future__ import annotations

import pytest
import torch

from megatron_like.kernels import fused_rms_norm
from megatron_like.model.norms import rms_norm
from tests.unit._kernel_backends import backend, compiled  # noqa: F401 - fixture

pytestmark = pytest.mark.usefixtures("backend")

# Per dtype: tolerance against the float64 formula of the same (rounded) inputs. 16-bit results carry the
# contract's roundings (the normalized row, then the product with the weight); the gradients a few more.
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (2e-3, 2e-3)}


def rms_norm_float64(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, eps: float):
    """Return float64 ``(out, dx, dw)`` of ``x / sqrt(mean(x^2) + eps) * w``, written independently of the kernels."""
    rx, rw = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    out = rx / torch.sqrt((rx * rx).sum(-1, keepdim=True) / rx.shape[-1] + eps) * rw
    out.backward(dy.double())
    return out.detach(), rx.grad, rw.grad


def assert_matches_float64(got, x, w, dy, eps, dtype, dw_scale: float = 1.0) -> None:
    """Check ``got = (out, dx, dw)`` against the float64 formula; ``dw`` (a row sum) gets ``dw_scale`` x the tol."""
    rtol, atol = TOL[dtype]
    for name, g, r in zip(("out", "dx", "dw"), got, rms_norm_float64(x, w, dy, eps)):
        scale = dw_scale if name == "dw" else 1.0
        torch.testing.assert_close(g.double(), r, rtol=rtol * scale, atol=atol * scale,
                                   msg=lambda m, n=name: f"{n}: {m}")


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
    assert_matches_float64((y, x.grad, w.grad), x, w, dy, 1e-5, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_every_dtype_matches_float64_and_the_model(dtype, backend):  # noqa: F811 - the fixture, for its name
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(6, 4, 96, generator=gen) * 2).to(dtype).requires_grad_()
    w = (1 + torch.randn(96, generator=gen) * 0.1).to(dtype).requires_grad_()
    dy = torch.randn(6, 4, 96, generator=gen).to(dtype)
    y = fused_rms_norm(x, w, 1e-6)
    y.backward(dy)
    assert y.dtype == x.grad.dtype == w.grad.dtype == dtype
    # dw sums 24 rows: a few roundings of 16-bit products add up.
    assert_matches_float64((y, x.grad, w.grad), x, w, dy, 1e-6, dtype, dw_scale=4.0)
    if compiled(backend):  # the fallback is the model's rms_norm itself: comparing them would prove nothing
        ref, rdx, rdw = reference_grads(x, w, dy, 1e-6, dtype)
        rtol, atol = TOL[dtype]
        torch.testing.assert_close(y, ref, rtol=rtol, atol=atol)
        torch.testing.assert_close(x.grad, rdx, rtol=rtol, atol=atol)
        torch.testing.assert_close(w.grad, rdw, rtol=rtol * 4, atol=atol * 4)


def test_rms_norm_weight_without_grad_and_strided_input():
    gen = torch.Generator().manual_seed(2)
    leaf = torch.randn(16, 5, generator=gen).requires_grad_()
    w = torch.randn(16, generator=gen)  # needs no gradient
    x = leaf.t()  # [5, 16] with strides (1, 5)
    assert not x.is_contiguous()
    dy = torch.randn(5, 16, generator=gen)
    y = fused_rms_norm(x, w, 1e-5)
    y.backward(dy)
    ref, rdx, _ = rms_norm_float64(x, w, dy, 1e-5)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(leaf.grad.double(), rdx.t(), rtol=1e-5, atol=1e-5)
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
    _, rdx, rdw = rms_norm_float64(x, w, dy, 1e-5)
    torch.testing.assert_close(w.grad.double(), rdw, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(x.grad.double(), rdx, rtol=1e-5, atol=1e-5)
