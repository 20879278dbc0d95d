"""Fused scale+mask+softmax (general mask and causal) against unfused PyTorch references."""

from __future__ import annotations

import pytest
import torch

from megatron_like.kernels import scaled_masked_softmax, scaled_upper_triang_masked_softmax
from tests.unit._kernel_backends import backend  # noqa: F401 - fixture

pytestmark = pytest.mark.usefixtures("backend")


def reference_softmax(x: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Independent float64 reference: masked entries -> 0, fully masked rows -> all zeros."""
    scores = x.double() * scale
    if mask is None:
        return torch.softmax(scores, dim=-1)
    mask = mask.expand_as(scores)
    row_max = scores.masked_fill(mask, float("-inf")).amax(-1, keepdim=True).detach()
    row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)
    e = torch.exp(scores.masked_fill(mask, 0.0) - row_max) * (~mask)
    total = e.sum(-1, keepdim=True)
    return e / torch.where(total > 0, total, 1.0)


def causal_mask(sq: int, sk: int) -> torch.Tensor:
    return torch.ones(sq, sk, dtype=torch.bool).triu(1).view(1, 1, sq, sk)


def random_mask(b: int, sq: int, sk: int, gen: torch.Generator) -> torch.Tensor:
    mask = torch.rand(b, 1, sq, sk, generator=gen) < 0.4
    mask[0, 0, 1, :] = True  # a fully masked row
    if b > 1:
        mask[-1, 0, -1, :] = True
    return mask


@pytest.mark.parametrize("shape", [(2, 3, 5, 17), (1, 2, 4, 64), (3, 1, 2, 1)])
@pytest.mark.parametrize("mask_kind", ["per_batch", "broadcast", "none"])
def test_masked_softmax_matches_reference_fp32(shape, mask_kind):
    gen = torch.Generator().manual_seed(0)
    b, np_, sq, sk = shape
    x = (torch.randn(shape, generator=gen) * 4).requires_grad_()
    mask = {"per_batch": random_mask(b, sq, sk, gen), "broadcast": random_mask(1, sq, sk, gen), "none": None}[mask_kind]
    y = scaled_masked_softmax(x, mask, scale=0.3)
    ref_x = x.detach().double().requires_grad_()
    ref = reference_softmax(ref_x, mask, 0.3)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-6)
    dy = torch.randn(shape, generator=gen)
    y.backward(dy)
    ref.backward(dy.double())
    torch.testing.assert_close(x.grad.double(), ref_x.grad, rtol=1e-5, atol=1e-6)


def test_fully_masked_rows_are_zero_with_zero_grad():
    x = torch.randn(2, 2, 3, 8, requires_grad=True)
    mask = torch.zeros(2, 1, 3, 8, dtype=torch.bool)
    mask[1, 0, 2] = True
    y = scaled_masked_softmax(x, mask, 1.0)
    assert torch.equal(y[1, :, 2], torch.zeros(2, 8))
    assert torch.allclose(y[0].sum(-1), torch.ones(2, 3))
    y.backward(torch.randn_like(y))
    assert torch.equal(x.grad[1, :, 2], torch.zeros(2, 8))
    assert torch.isfinite(x.grad).all()


def test_masked_entries_get_exactly_zero_probability():
    x = torch.randn(1, 1, 4, 9) * 50
    mask = torch.rand(1, 1, 4, 9, generator=torch.Generator().manual_seed(3)) < 0.5
    y = scaled_masked_softmax(x, mask, 1.0)
    assert torch.equal(y[mask.expand_as(y)], torch.zeros(int(mask.sum())))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_masked_softmax_half_precision(dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 2, 6, 40, generator=gen).to(dtype).requires_grad_()
    mask = random_mask(2, 6, 40, gen)
    y = scaled_masked_softmax(x, mask, 0.5)
    assert y.dtype == dtype
    ref_x = x.detach().double().requires_grad_()
    ref = reference_softmax(ref_x, mask, 0.5)
    torch.testing.assert_close(y.double(), ref, rtol=1e-2, atol=4e-3)
    dy = torch.randn(y.shape, generator=gen).to(dtype)
    y.backward(dy)
    ref.backward(dy.double())
    torch.testing.assert_close(x.grad.double(), ref_x.grad, rtol=2e-2, atol=4e-3)


def test_masked_softmax_non_contiguous_input():
    x = torch.randn(2, 16, 3, 6).transpose(1, 3)
    assert not x.is_contiguous()
    mask = random_mask(2, 3, 16, torch.Generator().manual_seed(2))
    torch.testing.assert_close(scaled_masked_softmax(x, mask, 1.0).double(), reference_softmax(x, mask, 1.0))


def test_masked_softmax_gradcheck_float64():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 2, 3, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    mask = random_mask(2, 3, 5, gen)
    assert torch.autograd.gradcheck(lambda t: scaled_masked_softmax(t, mask, 0.7), (x,))


@pytest.mark.parametrize("shape", [(2, 3, 7, 7), (1, 1, 33, 33), (4, 1, 1)])
def test_causal_softmax_matches_reference(shape):
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(shape, generator=gen) * 3).requires_grad_()
    sq = shape[-1]
    y = scaled_upper_triang_masked_softmax(x, scale=0.5)
    ref_x = x.detach().double().requires_grad_()
    ref = reference_softmax(ref_x, causal_mask(sq, sq).view(sq, sq), 0.5)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(y[..., causal_mask(sq, sq).view(sq, sq)], torch.zeros_like(y[..., causal_mask(sq, sq)[0, 0]]))
    dy = torch.randn(shape, generator=gen)
    y.backward(dy)
    ref.backward(dy.double())
    torch.testing.assert_close(x.grad.double(), ref_x.grad, rtol=1e-5, atol=1e-6)


def test_causal_softmax_bf16():
    x = torch.randn(2, 2, 12, 12).bfloat16()
    y = scaled_upper_triang_masked_softmax(x, 1.0)
    torch.testing.assert_close(y.double(), reference_softmax(x, causal_mask(12, 12), 1.0), rtol=1e-2, atol=4e-3)


def test_causal_softmax_gradcheck_float64():
    x = torch.randn(1, 2, 4, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: scaled_upper_triang_masked_softmax(t, 1.3), (x,))


def test_shape_errors():
    with pytest.raises(ValueError, match="square"):
        scaled_upper_triang_masked_softmax(torch.randn(1, 1, 3, 4))
    with pytest.raises(ValueError, match=r"\[b, np, sq, sk\]"):
        scaled_masked_softmax(torch.randn(3, 4), None)
    with pytest.raises(TypeError, match="boolean"):
        scaled_masked_softmax(torch.randn(1, 1, 2, 2), torch.zeros(1, 1, 2, 2))
