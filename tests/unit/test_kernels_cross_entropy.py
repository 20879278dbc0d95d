"""Fused vocabulary cross entropy against F.cross_entropy(reduction="none")."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_like.kernels import fused_vocab_cross_entropy
from tests.unit._kernel_backends import backend  # noqa: F401 - fixture

pytestmark = pytest.mark.usefixtures("backend")


@pytest.mark.parametrize("n,v", [(6, 50), (1, 1), (3, 1031)])
def test_cross_entropy_matches_reference(n, v):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(n, v, generator=gen) * 4).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=gen)
    loss = fused_vocab_cross_entropy(logits, targets)
    assert loss.dtype == torch.float32 and loss.shape == (n,)
    ref_logits = logits.detach().double().requires_grad_()
    ref = F.cross_entropy(ref_logits, targets, reduction="none")
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-5)
    g = torch.randn(n, generator=gen)
    loss.backward(g)
    ref.backward(g.double())
    torch.testing.assert_close(logits.grad.double(), ref_logits.grad, rtol=1e-5, atol=1e-6)


def test_cross_entropy_ignore_index_and_batch_shape():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 20, generator=gen).requires_grad_()
    targets = torch.randint(0, 20, (2, 3), generator=gen)
    targets[0, 1] = -100
    loss = fused_vocab_cross_entropy(logits, targets)
    assert loss.shape == (2, 3) and loss[0, 1] == 0
    ref_logits = logits.detach().clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.view(-1, 20), targets.view(-1), reduction="none").view(2, 3)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    loss.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad, rtol=1e-5, atol=1e-6)
    assert torch.equal(logits.grad[0, 1], torch.zeros(20))


def test_cross_entropy_is_stable_for_large_logits():
    logits = torch.tensor([[1e4, 0.0, -1e4], [-3e4, -3e4 + 1.0, -3e4 + 2.0]])
    targets = torch.tensor([1, 2])
    loss = fused_vocab_cross_entropy(logits, targets)
    torch.testing.assert_close(loss.double(), F.cross_entropy(logits.double(), targets, reduction="none"))


def test_cross_entropy_bf16_logits():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 300, generator=gen).bfloat16().requires_grad_()
    targets = torch.randint(0, 300, (4,), generator=gen)
    loss = fused_vocab_cross_entropy(logits, targets)
    assert loss.dtype == torch.float32
    ref = F.cross_entropy(logits.detach().double(), targets, reduction="none")
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-5)
    loss.sum().backward()
    assert logits.grad.dtype == torch.bfloat16


def test_cross_entropy_rejects_out_of_range_target():
    with pytest.raises(IndexError, match="out of range"):
        fused_vocab_cross_entropy(torch.randn(2, 5), torch.tensor([1, 5]))


def test_cross_entropy_gradcheck_float64():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 7, dtype=torch.float64, generator=gen, requires_grad=True)
    targets = torch.tensor([0, 6, -100])
    assert torch.autograd.gradcheck(lambda t: fused_vocab_cross_entropy(t, targets), (logits,))
