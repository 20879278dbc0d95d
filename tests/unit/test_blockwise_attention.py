"""The blockwise attention core equals dense masked attention (float64): forward and all three gradients.

The reference below builds its mask pair by pair in Python and runs plain softmax attention, so it shares no code
with megatron_like/model/blockwise_attention.py. Cases: causal, grouped-query attention, a sliding window, packed
documents, both at once, queries that see no key (a context-parallel block pair wholly in the future), and block
sizes that do not divide the sequence. The ring contract is checked too: per-block forwards merged by log-sum-exp and
per-block backwards summed give the whole attention's output and gradients.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_like.model.blockwise_attention import (
    attention_block_backward,
    attention_block_forward,
    block_plan,
    blockwise_attention,
    dropout_keep,
    merge_partials,
)

B, HQ, HKV, D = 2, 4, 2, 8


def reference_mask(q_positions, k_positions, q_documents, k_documents, window_left, causal):
    """bool [b, sq, sk], built one pair at a time."""
    sq, sk = len(q_positions), len(k_positions)
    mask = torch.zeros(B, sq, sk, dtype=torch.bool)
    for b in range(B):
        for i in range(sq):
            for j in range(sk):
                qp, kp = int(q_positions[i]), int(k_positions[j])
                ok = (not causal or kp <= qp) and (window_left is None or kp >= qp - window_left)
                if q_documents is not None:
                    ok = ok and int(q_documents[b, i]) == int(k_documents[b, j])
                mask[b, i, j] = ok
    return mask


def reference_attention(q, k, v, mask, dropout_scale=None):
    """Dense softmax attention with the key/value heads repeated per query group; rows with no key give 0;
    ``dropout_scale`` [b, h, sq, sk] multiplies the probabilities (0 where dropped, 1 / (1 - p) where kept)."""
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    mask = mask[:, None]
    seen = mask.any(-1, keepdim=True)
    scores = scores.masked_fill(~mask, float("-inf")).masked_fill(~seen, 0.0)
    probs = torch.softmax(scores, -1) * seen
    return torch.matmul(probs if dropout_scale is None else probs * dropout_scale, v)


def inputs(sq, sk, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, sq, D, generator=generator, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, HKV, sk, D, generator=generator, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, HKV, sk, D, generator=generator, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(B, HQ, sq, D, generator=generator, dtype=torch.float64)
    return q, k, v, grad_out


def documents_of(lengths_per_sample, s):
    """int64 [b, s] document ids from each sample's document lengths."""
    rows = [torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
            for lengths in lengths_per_sample]
    assert all(len(row) == s for row in rows)
    return torch.stack(rows)


S = 13
DOCS = documents_of([[5, 1, 7], [2, 9, 2]], S)  # a one-token document; boundaries differ per sample
CASES = {
    "causal": dict(),
    "window": dict(window_left=5),  # with blocks of 4, query 8's oldest key (3) is the last of an earlier block
    "documents": dict(q_documents=DOCS),
    "window_documents": dict(window_left=4, q_documents=DOCS),
    "bidirectional_documents": dict(causal=False, q_documents=DOCS),
}


@pytest.mark.parametrize("block_size", [4, 5, 13, 64])
@pytest.mark.parametrize("case", CASES)
def test_blockwise_equals_dense_reference(case, block_size):
    options = CASES[case]
    positions = torch.arange(S)
    mask = reference_mask(positions, positions, options.get("q_documents"), options.get("q_documents"),
                          options.get("window_left"), options.get("causal", True))
    q, k, v, grad_out = inputs(S, S)
    out, lse = blockwise_attention(q, k, v, block_size=block_size, **options)
    expected = reference_attention(q, k, v, mask)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad_out)
    for name, got, want in zip("qkv", grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=lambda m, name=name: f"d{name}: {m}")
    assert lse.shape == (B, HQ, S) and torch.isfinite(lse).all()


def test_queries_that_see_no_key_give_zero_output_and_gradient():
    # Keys at positions 6..15, queries at 0..9 (a ring step's block pair): queries 0..5 see nothing; a second call
    # with every query before every key is a context-parallel shard whose tokens are all masked.
    q, k, v, grad_out = inputs(10, 10)
    q_positions, k_positions = torch.arange(10), torch.arange(6, 16)
    mask = reference_mask(q_positions, k_positions, None, None, None, True)
    out, lse = blockwise_attention(q, k, v, q_positions=q_positions, k_positions=k_positions, block_size=4)
    expected = reference_attention(q, k, v, mask)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
    assert torch.isneginf(lse[:, :, :6]).all() and torch.isfinite(lse[:, :, 6:]).all()
    for got, want in zip(torch.autograd.grad(out, (q, k, v), grad_out),
                         torch.autograd.grad(expected, (q, k, v), grad_out)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)

    out, lse = attention_block_forward(q, k, v, q_positions=q_positions, k_positions=k_positions + 10)
    assert (out == 0).all() and torch.isneginf(lse).all()
    grads = attention_block_backward(q, k, v, out, lse, grad_out, q_positions=q_positions,
                                     k_positions=k_positions + 10)
    assert all((g == 0).all() for g in grads)
    merged, merged_lse = merge_partials(out, lse, out, lse)
    assert (merged == 0).all() and torch.isneginf(merged_lse).all()


@pytest.mark.parametrize("tile", [None, 3])
@pytest.mark.parametrize("case", ["causal", "window_documents"])
def test_ring_contract_blocks_merge_and_gradients_sum(case, tile):
    """Key blocks processed one at a time, as a ring step sees them (in a scrambled order), give the whole answer;
    ``tile``: each step also tiles its block pair (``block_size``)."""
    options = dict(CASES[case])
    documents = options.pop("q_documents", None)
    q, k, v, grad_out = inputs(S, S, seed=1)
    positions = torch.arange(S)
    expected = reference_attention(q, k, v, reference_mask(positions, positions, documents, documents,
                                                           options.get("window_left"), True))
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad_out)
    key_blocks = [slice(8, 13), slice(0, 4), slice(4, 8)]

    def block_options(block):
        return dict(q_positions=positions, k_positions=positions[block], q_documents=documents,
                    k_documents=None if documents is None else documents[:, block], block_size=tile, **options)

    with torch.no_grad():
        out = lse = None
        for block in key_blocks:
            part, part_lse = attention_block_forward(q, k[:, :, block], v[:, :, block], **block_options(block))
            out, lse = (part, part_lse) if out is None else merge_partials(out, lse, part, part_lse)
    torch.testing.assert_close(out, expected.detach(), rtol=1e-10, atol=1e-12)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for block in key_blocks:
        dq_part, dk_part, dv_part = attention_block_backward(q.detach(), k[:, :, block].detach(),
                                                             v[:, :, block].detach(), out, lse, grad_out,
                                                             **block_options(block))
        dq += dq_part
        dk[:, :, block] += dk_part
        dv[:, :, block] += dv_part
    for got, want in zip((dq, dk, dv), expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_plan_skips_the_tiles_without_an_allowed_pair():
    """Compute follows the allowed pairs: 8 blocks of 8 tokens; causal keeps the 36 tiles on and below the diagonal,
    a window of 8 keys only the diagonal and the block before it (10 keys: and the last key of the block before
    that), documents of 16 tokens only their own tiles."""
    s, block = 64, 8
    positions = torch.arange(s)

    def tiles(**options):
        options = dict(q_documents=None, k_documents=None, window_left=None, causal=True) | options
        plan = block_plan(positions, positions, block_q=block, block_k=block, **options)
        return sum(len(k_slices) for _, k_slices in plan)

    assert tiles() == 8 * 9 // 2
    assert tiles(window_left=7) == 8 + 7
    assert tiles(window_left=9) == 8 + 7 + 6
    documents = (positions // 16).expand(B, s)
    assert tiles(q_documents=documents, k_documents=documents) == 4 * 3
    assert tiles(causal=False) == 64


def test_bfloat16_is_close_to_float64():
    """Half-precision inputs are computed in float32: output and gradients come back in bfloat16, near float64's."""
    q, k, v, grad_out = inputs(S, S, seed=2)
    options = CASES["window_documents"]
    low = [t.detach().bfloat16().requires_grad_() for t in (q, k, v)]
    out, lse = blockwise_attention(*low, block_size=4, **options)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    grads = torch.autograd.grad(out, low, grad_out.bfloat16())
    expected, _ = blockwise_attention(q, k, v, block_size=4, **options)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad_out)
    torch.testing.assert_close(out.double(), expected, rtol=0.02, atol=0.02)
    for got, want in zip(grads, expected_grads):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double(), want, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("block_size", [4, 13])
def test_dropout_equals_dense_attention_with_the_same_pairs_dropped(block_size):
    """The mask is a function of (seed, sample, head, query position, key position): any tiling gives the same
    output, and the gradients are those of dense attention that drops the same pairs."""
    p, seed = 0.3, 1234
    q, k, v, grad_out = inputs(S, S, seed=3)
    options = CASES["window_documents"]
    positions = torch.arange(S)
    mask = reference_mask(positions, positions, DOCS, DOCS, options["window_left"], True)
    keep = dropout_keep(seed, B, HQ, positions, positions, p)
    out, _ = blockwise_attention(q, k, v, block_size=block_size, dropout_p=p, dropout_seed=seed, **options)
    expected = reference_attention(q, k, v, mask, keep.double() / (1 - p))
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), grad_out),
                         torch.autograd.grad(expected, (q, k, v), grad_out)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_dropout_keeps_one_minus_p_of_the_pairs_and_follows_the_seed():
    positions = torch.arange(256)
    keep = dropout_keep(7, 2, 4, positions, positions, 0.25)
    assert abs(keep.double().mean().item() - 0.75) < 0.005  # 524288 draws: the standard error is 0.0006
    assert abs(keep[:, :, :, ::2].double().mean().item() - 0.75) < 0.005  # no pattern along the keys
    other = dropout_keep(8, 2, 4, positions, positions, 0.25)
    assert 0.3 < (keep != other).double().mean().item() < 0.45  # independent: 2 * 0.25 * 0.75 differ
    assert torch.equal(dropout_keep(7, 2, 4, positions[100:], positions[:50], 0.25), keep[:, :, 100:, :50])
