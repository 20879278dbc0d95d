"""LayerNorm and the fused bias + residual + LayerNorm against unfused PyTorch references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_like.kernels import fused_add_layer_norm, layer_norm
from tests.unit._kernel_backends import backend  # noqa: F401 - fixture

pytestmark = pytest.mark.usefixtures("backend")


def leaves(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    return [None if t is None else t.detach().clone().requires_grad_() for t in tensors]


def as_double(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    return [None if t is None else t.detach().double().requires_grad_() for t in tensors]


@pytest.mark.parametrize("shape", [(3, 4, 32), (5, 37), (1, 3)])
def test_layer_norm_matches_reference(shape):
    gen = torch.Generator().manual_seed(0)
    h = shape[-1]
    x, w, b = leaves(
        torch.randn(shape, generator=gen) * 3 + 1, torch.randn(h, generator=gen), torch.randn(h, generator=gen)
    )
    y = layer_norm(x, w, b, eps=1e-5)
    rx, rw, rb = as_double(x, w, b)
    ref = F.layer_norm(rx, (h,), rw, rb, 1e-5)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    dy = torch.randn(shape, generator=gen)
    y.backward(dy)
    ref.backward(dy.double())
    for got, want in [(x, rx), (w, rw), (b, rb)]:
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=1e-5, atol=1e-5)


def test_layer_norm_without_affine():
    x = torch.randn(4, 16)
    torch.testing.assert_close(layer_norm(x, None, None, 1e-6), F.layer_norm(x, (16,), eps=1e-6), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("with_residual", [True, False])
def test_fused_add_layer_norm_matches_reference(with_bias, with_residual):
    gen = torch.Generator().manual_seed(1)
    shape, h = (2, 5, 24), 24
    x, r, xb, w, b = leaves(
        torch.randn(shape, generator=gen),
        torch.randn(shape, generator=gen) if with_residual else None,
        torch.randn(h, generator=gen) if with_bias else None,
        torch.randn(h, generator=gen),
        torch.randn(h, generator=gen),
    )
    out, s = fused_add_layer_norm(x, r, w, b, 1e-5, x_bias=xb)
    rx, rr, rxb, rw, rb = as_double(x, r, xb, w, b)
    rs = rx + (rxb if rxb is not None else 0) + (rr if rr is not None else 0)
    rout = F.layer_norm(rs, (h,), rw, rb, 1e-5)
    torch.testing.assert_close(s.double(), rs, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.double(), rout, rtol=1e-5, atol=1e-5)
    dout, ds = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    torch.autograd.backward([out, s], [dout, ds])
    torch.autograd.backward([rout, rs], [dout.double(), ds.double()])
    for got, want in [(x, rx), (r, rr), (xb, rxb), (w, rw), (b, rb)]:
        if got is not None:
            torch.testing.assert_close(got.grad.double(), want.grad, rtol=1e-5, atol=1e-5)


def test_fused_add_layer_norm_unused_sum_output():
    x, r, w, b = leaves(torch.randn(3, 8), torch.randn(3, 8), torch.randn(8), torch.randn(8))
    out, _ = fused_add_layer_norm(x, r, w, b)
    out.sum().backward()
    rx, rr, rw, rb = as_double(x, r, w, b)
    F.layer_norm(rx + rr, (8,), rw, rb).sum().backward()
    torch.testing.assert_close(x.grad.double(), rx.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(r.grad.double(), rr.grad, rtol=1e-5, atol=1e-5)


def test_layer_norm_bf16():
    gen = torch.Generator().manual_seed(2)
    x, r, w, b = leaves(
        *tuple(torch.randn(4, 64, generator=gen).bfloat16() for _ in range(2))
        + tuple(torch.randn(64, generator=gen).bfloat16() for _ in range(2))
    )
    out, s = fused_add_layer_norm(x, r, w, b)
    assert out.dtype == s.dtype == torch.bfloat16
    # The sum is rounded to bf16 first and the LN normalizes that rounded sum.
    rs = (x.detach() + r.detach()).double()
    torch.testing.assert_close(s.double(), rs)
    ref = F.layer_norm(rs, (64,), w.detach().double(), b.detach().double())
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=3e-2)
    out.float().square().sum().backward()
    assert all(torch.isfinite(t.grad.float()).all() for t in (x, r, w, b))


def test_layer_norm_gradcheck_float64():
    gen = torch.Generator().manual_seed(3)
    tensors = [
        torch.randn(s, dtype=torch.float64, generator=gen, requires_grad=True)
        for s in [(3, 6), (3, 6), (6,), (6,), (6,)]
    ]

    def fn(x, r, xb, w, b):
        return fused_add_layer_norm(x, r, w, b, 1e-5, x_bias=xb)

    assert torch.autograd.gradcheck(fn, tuple(tensors))
    assert torch.autograd.gradcheck(lambda x, w, b: layer_norm(x, w, b), (tensors[0], tensors[3], tensors[4]))
