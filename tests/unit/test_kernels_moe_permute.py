"""MoE token permutation and un-permutation against loop references, and the three ops composed as a layer."""

from __future__ import annotations

import pytest
import torch

from megatron_like.kernels import grouped_gemm, permute, tokens_per_expert, unpermute

E, TOPK, H = 4, 2, 6


def routing(num_tokens: int, seed: int = 0, drop: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k expert indices [T, topk] (distinct per token) and router probs [T, topk]; -1 = dropped slot."""
    gen = torch.Generator().manual_seed(seed)
    indices = torch.stack([torch.randperm(E, generator=gen)[:TOPK] for _ in range(num_tokens)])
    if drop:
        indices[torch.rand(indices.shape, generator=gen) < 0.3] = -1
    probs = torch.rand(num_tokens, TOPK, generator=gen).softmax(-1)
    return indices, probs


def loop_permute(tokens, indices):
    """Rows grouped by expert, token order inside an expert, written as the obvious loops."""
    rows, slots = [], []
    for e in range(E):
        for t in range(indices.shape[0]):
            for j in range(indices.shape[1]):
                if indices[t, j] == e:
                    rows.append(tokens[t])
                    slots.append(t * indices.shape[1] + j)
    return torch.stack(rows), torch.tensor(slots)


@pytest.mark.parametrize("drop", [False, True])
def test_permute_matches_loop_reference(drop):
    indices, _ = routing(9, drop=drop)
    tokens = torch.randn(9, H)
    permuted, row_map = permute(tokens, indices, E)
    want_rows, want_slots = loop_permute(tokens, indices)
    torch.testing.assert_close(permuted, want_rows, rtol=0, atol=0)
    assert row_map.tolist() == want_slots.tolist()
    counts = tokens_per_expert(indices, E)
    assert counts.device.type == "cpu" and counts.dtype == torch.int64
    assert counts.tolist() == [int((indices == e).sum()) for e in range(E)]
    assert permuted.shape[0] == int(counts.sum()) == int((indices >= 0).sum())


@pytest.mark.parametrize("drop", [False, True])
def test_unpermute_and_gradients_match_loop_reference(drop):
    """out[t] = sum_j probs[t, j] * f_e(x[t]) with a per-expert scale as the expert; grads of tokens and probs."""
    indices, probs = routing(11, seed=1, drop=drop)
    scale = torch.arange(1.0, E + 1)
    tokens = torch.randn(11, H, requires_grad=True)
    probs = probs.requires_grad_()
    permuted, row_map = permute(tokens, indices, E)
    expert_of_row = torch.repeat_interleave(torch.arange(E), tokens_per_expert(indices, E))
    out = unpermute(permuted * scale[expert_of_row].unsqueeze(-1), row_map, probs)
    dy = torch.randn_like(out)
    out.backward(dy)

    ref_tokens, ref_probs = tokens.detach().clone().requires_grad_(), probs.detach().clone().requires_grad_()
    ref = []
    for t in range(11):
        acc = torch.zeros(H)
        for j in range(TOPK):
            e = int(indices[t, j])
            if e >= 0:
                acc = acc + ref_probs[t, j] * scale[e] * ref_tokens[t]
        ref.append(acc)
    ref = torch.stack(ref)
    ref.backward(dy)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(tokens.grad, ref_tokens.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(probs.grad, ref_probs.grad, rtol=1e-6, atol=1e-6)


def test_unpermute_sums_bf16_copies_in_fp32():
    """bf16 expert outputs with fp32 probs: weighted and summed in fp32, rounded to bf16 once."""
    indices, probs = routing(5, seed=2)
    tokens = torch.randn(5, H).bfloat16()
    permuted, row_map = permute(tokens, indices, E)
    out = unpermute(permuted, row_map, probs)
    assert out.dtype == torch.bfloat16
    want = (tokens.float() * probs.sum(-1, keepdim=True)).bfloat16()
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_moe_layer_from_permute_grouped_gemm_unpermute():
    """The three ops as an MoE expert layer equal sum_j p[t, j] * x[t] @ w[e(t, j)] computed per token."""
    indices, probs = routing(13, seed=3)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(13, H, generator=gen, requires_grad=True)
    w = torch.randn(E, H, 5, generator=gen, requires_grad=True)
    probs = probs.requires_grad_()
    permuted, row_map = permute(x, indices, E)
    out = unpermute(grouped_gemm(permuted, w, tokens_per_expert(indices, E)), row_map, probs)
    out.square().sum().backward()

    xr, wr, pr = (t.detach().double().requires_grad_() for t in (x, w, probs))
    ref = torch.einsum("tj,tk,tjkn->tn", pr, xr, wr[indices])
    ref.square().sum().backward()
    for got, want in ((out, ref), (x.grad, xr.grad), (w.grad, wr.grad), (probs.grad, pr.grad)):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_permute_zero_tokens():
    permuted, row_map = permute(torch.randn(0, H), torch.zeros(0, TOPK, dtype=torch.int64), E)
    assert permuted.shape == (0, H) and row_map.shape == (0,)
    assert unpermute(permuted, row_map, torch.zeros(0, TOPK)).shape == (0, H)
    assert tokens_per_expert(torch.zeros(0, TOPK, dtype=torch.int64), E).tolist() == [0] * E


@pytest.mark.parametrize(
    ("indices", "match"),
    [
        (torch.tensor([[0, 4], [1, 2]]), r"span \[0, 4\]"),
        (torch.tensor([[0, -2], [1, 2]]), r"span \[-2, 2\]"),
        (torch.tensor([0, 1]), r"int64 \[T, topk\]"),
        (torch.tensor([[0, 1]]), "1 rows but there are 2 tokens"),
    ],
)
def test_permute_rejects_bad_routing(indices, match):
    with pytest.raises(ValueError, match=match):
        permute(torch.randn(2, H), indices, E)
