"""Attention across context-parallel ranks equals single-process attention, in float64: every --cp-comm-type at
cp 2 and 4, causal, grouped-query, sliding-window and bidirectional attention, packed documents (with GQA and a
window; documents cut by the chunk boundaries, one of a single token), a cp rank whose tokens are all
masked out of the loss (its queries get no gradient; its keys and values still serve the others), and multi-latent
attention's shapes (value heads narrower than query/key heads; with documents and a masked rank too). Forward
output and the gradients of q, k and v are compared on every rank with a dense masked softmax written out here.

With attention dropout (GQA, a window and packed documents) every mode equals the single-process blockwise core
drawing its seed from the same torch seed (the same pairs dropped), and each mode's backward is checked to be the
gradient of its own forward: the directional derivative along a random direction, by central differences
of the whole sequence's loss with the dropout masks drawn again from the same seed, equals the one the gradients
give; and the dropout is on (the output differs from the undropped one).

Also: the ring computes each (query chunk, key chunk) tile at most once and skips the ones wholly above the causal
diagonal (the count of computed tiles is that of a lower triangle), and the load-balanced layout gives every rank
the same number of tiles.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from megatron_like.config import ParallelConfig
from megatron_like.model.blockwise_attention import blockwise_attention
from megatron_like.model.context_parallel import Ring, context_parallel_attention, cp_positions, sequence_mean_loss
from megatron_like.model.context_parallel.layout import split_for_context_parallel
from megatron_like.model.context_parallel.ring import ring_step_tiles
from megatron_like.parallel_state import ParallelState
from tests.distributed.harness import run_distributed

SEQ, BATCH, HEAD_DIM = 16, 2, 4
MLA_V_DIM = 3  # multi-latent attention's value heads are narrower than its query/key heads (nope + rope)
MODES = {2: ["p2p", "all_gather", "a2a", "a2a+p2p"], 4: ["p2p", "all_gather", "a2a", "a2a+p2p"]}
HIERARCHY = {2: [1, 2], 4: [2, 2]}  # a2a+p2p: all-to-all size, ring size
CASES = {
    # name: (query heads, key/value heads, window_left, causal, cp rank whose loss is all masked, packed documents,
    #        value head dim)
    "causal": (4, 4, None, True, None, False, HEAD_DIM),
    "gqa": (8, 4, None, True, None, False, HEAD_DIM),
    "window": (4, 4, 4, True, None, False, HEAD_DIM),
    "bidirectional": (4, 4, None, False, None, False, HEAD_DIM),
    "masked-rank": (4, 4, None, True, 0, False, HEAD_DIM),
    "documents-gqa-window": (8, 4, 6, True, None, True, HEAD_DIM),
    "mla": (4, 4, None, True, None, False, MLA_V_DIM),
    "mla-documents-masked-rank": (4, 4, None, True, 1, True, MLA_V_DIM),
}
# Packed documents: per sample, the positions where a new document starts (sample 1: a one-token document).
DOCUMENT_STARTS = [(5, 11), (3, 4, 13)]


def document_ids() -> torch.Tensor:
    """int64 ``[b, s]``: the document of each token (its count of document starts up to it)."""
    starts = torch.zeros(BATCH, SEQ, dtype=torch.int64)
    for sample, positions in enumerate(DOCUMENT_STARTS):
        starts[sample, list(positions)] = 1
    return starts.cumsum(dim=1)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window_left: int | None,
                    causal: bool, documents: torch.Tensor | None) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + mask) v over the whole sequence: q ``[b, hq, s, d]``, k, v ``[b, hkv, s, d]``."""
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    position = torch.arange(q.shape[2])
    distance = position[:, None] - position[None, :]
    allowed = torch.ones_like(distance, dtype=torch.bool).expand(q.shape[0], 1, -1, -1)
    if causal:
        allowed = allowed & (distance >= 0)
    if window_left is not None:
        allowed = allowed & (distance <= window_left)
    if documents is not None:
        allowed = allowed & (documents[:, None, :, None] == documents[:, None, None, :])
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v


def inputs(hq: int, hkv: int, masked_rank: int | None, cp: int, v_dim: int = HEAD_DIM) -> list[torch.Tensor]:
    """q, k, v and the output's gradient of the whole sequence (the same on every rank: one seed)."""
    generator = torch.Generator().manual_seed(hq * 100 + hkv)
    shapes = [(BATCH, hq, SEQ, HEAD_DIM), (BATCH, hkv, SEQ, HEAD_DIM), (BATCH, hkv, SEQ, v_dim),
              (BATCH, hq, SEQ, v_dim)]
    q, k, v, grad_out = (torch.randn(shape, generator=generator, dtype=torch.float64) for shape in shapes)
    if masked_rank is not None:  # the loss ignores every token of that rank: its outputs get no gradient
        positions = cp_positions(SEQ, cp, masked_rank)
        grad_out[:, :, positions] = 0.0
    return [q, k, v, grad_out]


def reference(case: str, cp: int) -> tuple[torch.Tensor, ...]:
    """Single-process output and q, k, v gradients ``[b, h, s, d]``."""
    hq, hkv, window_left, causal, masked_rank, documents, v_dim = CASES[case]
    q, k, v, grad_out = inputs(hq, hkv, masked_rank, cp, v_dim)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = dense_attention(q, k, v, window_left, causal, document_ids() if documents else None)
    out.backward(grad_out)
    return out.detach(), q.grad, k.grad, v.grad


def initialize_cp(mode: str, world_size: int) -> ParallelState:
    """This rank's parallel state with every rank in one context-parallel group of comm type ``mode``."""
    hierarchy = HIERARCHY[world_size] if mode == "a2a+p2p" else None
    parallel = ParallelConfig(context_parallel_size=world_size, cp_comm_type=mode,
                              hierarchical_context_parallel_sizes=hierarchy)
    return ParallelState.initialize(parallel, world_size)


def cp_attention_on_ranks(rank: int, world_size: int) -> dict[str, list[torch.Tensor]]:
    """Every (mode, case) on this rank: its output and gradients, local ``[b, h, s / cp, d]``."""
    import torch.distributed as dist

    results = {}
    for mode in MODES[world_size]:
        ps = initialize_cp(mode, world_size)
        assert dist.is_initialized() and ps.cp_rank == rank
        for case, (hq, hkv, window_left, causal, masked_rank, documents, v_dim) in CASES.items():
            q, k, v, grad_out = (split_for_context_parallel(t, world_size, rank, dim=2)
                                 for t in inputs(hq, hkv, masked_rank, world_size, v_dim))
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            local_documents = split_for_context_parallel(document_ids(), world_size, rank) if documents else None
            out = context_parallel_attention(q, k, v, ps, window_left=window_left, causal=causal,
                                             document_ids=local_documents)
            out.backward(grad_out)
            results[f"{mode}/{case}"] = [out.detach(), q.grad, k.grad, v.grad]
        results[f"{mode}/dropout"] = dropout_attention_on_rank(ps)
    results["loss"] = sequence_loss_on_rank(ps)
    return results


DROPOUT = 0.3
DROPOUT_SEED = 99  # the torch seed each side draws the attention dropout's seed from


def dropout_attention_on_rank(ps: ParallelState) -> list[torch.Tensor]:
    """Grouped-query attention with a window, packed documents and attention dropout on this cp rank: output and
    gradients, local ``[b, h, s / cp, d]``."""
    q, k, v, grad_out = (split_for_context_parallel(t, ps.cp_size, ps.cp_rank, dim=2) for t in inputs(8, 4, None, 2))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    torch.manual_seed(DROPOUT_SEED)
    out = context_parallel_attention(q, k, v, ps, window_left=6, dropout_p=DROPOUT,
                                     document_ids=split_for_context_parallel(document_ids(), ps.cp_size, ps.cp_rank))
    out.backward(grad_out)
    return [out.detach(), q.grad, k.grad, v.grad]


def loss_inputs(cp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token losses ``[b, s]`` and a loss mask that masks every token of cp rank 0 and some of the others."""
    per_token = torch.rand(BATCH, SEQ, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    mask = (torch.arange(SEQ) % 3 != 0).to(torch.float64).expand(BATCH, SEQ).clone()
    mask[:, cp_positions(SEQ, cp, 0)] = 0.0
    return per_token, mask


def sequence_loss_on_rank(ps: ParallelState) -> list[torch.Tensor]:
    """The reported loss and the gradient of the backpropagated one, divided by cp (the dp x cp average)."""
    per_token, mask = (split_for_context_parallel(t, ps.cp_size, ps.cp_rank) for t in loss_inputs(ps.cp_size))
    per_token.requires_grad_()
    loss, reported = sequence_mean_loss(per_token, mask, ps)
    loss.backward()
    return [reported, per_token.grad / ps.cp_size]


def dropout_checks_on_ranks(rank: int, world_size: int) -> dict[str, list[float]]:
    """Per mode: (directional derivative from the gradients, from central differences, largest change the dropout
    makes to the output), each summed or maximised over the cp ranks."""
    import torch.distributed as dist

    from megatron_like import collectives as comm

    results = {}
    for mode in MODES[world_size]:
        ps = initialize_cp(mode, world_size)
        q, k, v, grad_out = (split_for_context_parallel(t, world_size, rank, dim=2) for t in inputs(8, 4, None, 2))
        generator = torch.Generator().manual_seed(7)
        directions = [torch.randn(t.shape, generator=generator, dtype=torch.float64) for t in (q, k, v)]

        def loss(eps: float, dropout_p: float = DROPOUT) -> torch.Tensor:
            torch.manual_seed(1234 + rank)  # the same masks at every evaluation
            shifted = [(t + eps * u).requires_grad_() for t, u in zip((q, k, v), directions)]
            out = context_parallel_attention(*shifted, ps, dropout_p=dropout_p)
            return (out * grad_out).sum(), shifted, out

        value, leaves, out = loss(0.0)
        value.backward()
        analytic = sum((leaf.grad * u).sum() for leaf, u in zip(leaves, directions)).reshape(1)
        eps = 1e-6
        numeric = ((loss(eps)[0] - loss(-eps)[0]) / (2 * eps)).detach().reshape(1)
        changed = (out - loss(0.0, dropout_p=0.0)[2]).abs().max().detach().reshape(1)
        totals = torch.cat([analytic, numeric]).detach()
        comm.all_reduce(totals, ps.cp_group)
        comm.all_reduce(changed, ps.cp_group, op="max")
        assert dist.is_initialized()
        results[mode] = totals.tolist() + changed.tolist()
    return results


@functools.cache
def dropout_runs() -> dict[str, list[float]]:
    return run_distributed(dropout_checks_on_ranks, 2)[0]


@pytest.mark.parametrize("mode", MODES[2])
def test_attention_dropout_backward_is_the_gradient_of_its_forward(mode: str) -> None:
    analytic, numeric, changed = dropout_runs()[mode]
    assert analytic == pytest.approx(numeric, rel=1e-6)
    assert changed > 0.1


@functools.cache
def runs(cp: int) -> list[dict[str, list[torch.Tensor]]]:
    return run_distributed(cp_attention_on_ranks, cp)


@pytest.mark.parametrize("cp,mode,case", [(cp, mode, case) for cp, modes in MODES.items() for mode in modes
                                          for case in CASES])
def test_context_parallel_attention_equals_single_process(cp: int, mode: str, case: str) -> None:
    expected = reference(case, cp)
    for rank, per_rank in enumerate(runs(cp)):
        got = per_rank[f"{mode}/{case}"]
        for name, value, whole in zip(("out", "dq", "dk", "dv"), got, expected):
            torch.testing.assert_close(value, split_for_context_parallel(whole, cp, rank, dim=2), rtol=1e-10,
                                       atol=1e-12, msg=lambda m, name=name, rank=rank: f"rank {rank} {name}: {m}")
    if CASES[case][4] is not None:  # the masked rank's queries get no gradient, its keys and values do
        masked = runs(cp)[CASES[case][4]][f"{mode}/{case}"]
        assert masked[1].abs().max() == 0 and masked[2].abs().max() > 0


@pytest.mark.parametrize("cp,mode", [(cp, mode) for cp, modes in MODES.items() for mode in modes])
def test_attention_dropout_equals_single_process_dropout(cp: int, mode: str) -> None:
    """The same pairs dropped as one process's blockwise core drops from the same seed: every mode numbers heads
    and positions globally (the all-to-all modes offset their slice of the heads)."""
    q, k, v, grad_out = inputs(8, 4, None, 2)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    torch.manual_seed(DROPOUT_SEED)
    out = blockwise_attention(q, k, v, q_documents=document_ids(), window_left=6, dropout_p=DROPOUT, block_size=5)[0]
    out.backward(grad_out)
    undropped = blockwise_attention(q, k, v, q_documents=document_ids(), window_left=6)[0]
    assert (out - undropped).abs().max() > 0.1  # the dropout is on
    for rank, per_rank in enumerate(runs(cp)):
        for name, value, whole in zip(("out", "dq", "dk", "dv"), per_rank[f"{mode}/dropout"],
                                      (out.detach(), q.grad, k.grad, v.grad)):
            torch.testing.assert_close(value, split_for_context_parallel(whole, cp, rank, dim=2), rtol=1e-10,
                                       atol=1e-12, msg=lambda m, name=name, rank=rank: f"rank {rank} {name}: {m}")


@pytest.mark.parametrize("cp", [2, 4])
def test_loss_is_the_mean_over_the_whole_sequence(cp: int) -> None:
    """Not a mean of per-rank means (the ranks hold different numbers of unmasked tokens; rank 0 none)."""
    per_token, mask = (t.clone() for t in loss_inputs(cp))
    per_token.requires_grad_()
    expected = (per_token * mask).sum() / mask.sum()
    expected.backward()
    for rank, per_rank in enumerate(runs(cp)):
        reported, grad = per_rank["loss"]
        # float32 sums, as the single-process loss_func's
        torch.testing.assert_close(reported, expected.detach(), rtol=1e-6, atol=0, check_dtype=False)
        torch.testing.assert_close(grad, split_for_context_parallel(per_token.grad, cp, rank), rtol=1e-6, atol=0,
                                   check_dtype=False)


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_skips_the_tiles_above_the_diagonal_and_balances_the_rest(cp: int) -> None:
    chunks = 2 * cp
    per_rank = []
    for rank in range(cp):
        ring = Ring(list(range(cp)), rank, [cp_positions(SEQ, cp, r) for r in range(cp)], tile=SEQ // chunks)
        per_rank.append(sum(len(k_tiles) for step in range(cp)
                            for _, k_tiles in ring_step_tiles(ring, step, window_left=None, causal=True)))
    assert sum(per_rank) == chunks * (chunks + 1) // 2  # the causal lower triangle of chunk pairs, diagonal included
    assert len(set(per_rank)) == 1  # load balance: chunks r and 2 cp - 1 - r make every rank's work equal
