"""Fused rotary apply against the model's reference ``apply_rotary``, on every backend."""

from __future__ import annotations

import pytest
import torch

from megatron_like.kernels import fused_apply_rotary
from megatron_like.model.rotary import apply_rotary, rotary_cos_sin
from tests.unit._kernel_backends import backend  # noqa: F401 - fixture

pytestmark = pytest.mark.usefixtures("backend")

def qkv_view(gen: torch.Generator, s: int, b: int, heads: int, hd: int, dtype: torch.dtype) -> torch.Tensor:
    """A leaf ``[s, b, 2 heads, hd]`` and its first half as ``[b, heads, s, hd]``: a strided view, as the
    model's query heads are of its QKV output."""
    leaf = torch.randn(s, b, 2 * heads, hd, generator=gen).to(dtype).requires_grad_()
    return leaf, leaf[:, :, :heads].permute(1, 2, 0, 3)


def rotated_halves_differ(s: int, rd: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tables whose two halves differ (the model's repeat them): catches a backward using the wrong half."""
    gen = torch.Generator().manual_seed(9)
    return torch.randn(s, rd, generator=gen), torch.randn(s, rd, generator=gen)


@pytest.mark.parametrize("hd,rd", [(16, 16), (16, 8), (10, 4)])
@pytest.mark.parametrize("tables", ["model", "general"])
def test_rotary_matches_float64_reference(hd, rd, tables):
    gen = torch.Generator().manual_seed(0)
    s, b, heads = 7, 2, 3
    leaf, x = qkv_view(gen, s, b, heads, hd, torch.float32)
    if tables == "model":
        cos, sin = rotary_cos_sin(torch.arange(3, 3 + s), rd, 10000.0)
    else:
        cos, sin = rotated_halves_differ(s, rd)
    y = fused_apply_rotary(x, cos, sin)
    dy = torch.randn(y.shape, generator=gen)
    y.backward(dy)
    ref_leaf = leaf.detach().double().requires_grad_()
    rx = ref_leaf[:, :, :heads].permute(1, 2, 0, 3)
    ref = apply_rotary(rx, cos.double(), sin.double())
    ref.backward(dy.double())
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(leaf.grad.double(), ref_leaf.grad, rtol=1e-5, atol=1e-6)
    assert torch.equal(y[..., rd:], x[..., rd:])  # the pass-through columns are copied exactly


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rotary_matches_model_reference(dtype):
    """Bit for bit: the kernel rounds every product and sum to the dtype where the reference does (and
    does not fuse them into FMAs), so the model computes the same with and without csrc."""
    gen = torch.Generator().manual_seed(1)
    s, b, heads, hd, rd = 9, 2, 4, 32, 16
    leaf, x = qkv_view(gen, s, b, heads, hd, dtype)
    cos, sin = rotary_cos_sin(torch.arange(s), rd, 500000.0)
    y = fused_apply_rotary(x, cos, sin)
    dy = torch.randn(y.shape, generator=gen).to(dtype)
    y.backward(dy)
    assert y.dtype == leaf.grad.dtype == dtype and y.shape == x.shape
    ref_leaf = leaf.detach().clone().requires_grad_()
    ref = apply_rotary(ref_leaf[:, :, :heads].permute(1, 2, 0, 3), cos, sin)
    ref.backward(dy)
    torch.testing.assert_close(y, ref, rtol=0, atol=0)
    torch.testing.assert_close(leaf.grad, ref_leaf.grad, rtol=0, atol=0)


def test_rotary_tables_with_grad_take_the_pytorch_path():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1, 2, 5, 8, generator=gen)
    cos, sin = (t.requires_grad_() for t in rotated_halves_differ(5, 8))
    fused_apply_rotary(x, cos, sin).sum().backward()
    rcos, rsin = cos.detach().clone().requires_grad_(), sin.detach().clone().requires_grad_()
    apply_rotary(x, rcos, rsin).sum().backward()
    torch.testing.assert_close(cos.grad, rcos.grad)
    torch.testing.assert_close(sin.grad, rsin.grad)


def test_rotary_gradcheck_float64():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 2, 3, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    cos, sin = (t.double() for t in rotated_halves_differ(3, 4))
    assert torch.autograd.gradcheck(lambda t: fused_apply_rotary(t, cos, sin), (x,))
