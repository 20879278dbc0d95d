"""Attention across the context-parallel ranks, the four ways of ``--cp-comm-type`` (Megatron-LM's names).

Each rank holds queries, keys and values of its two sequence chunks, ``[b, h, s / cp, d]`` (``layout.py``; the
values' head dim ``dv`` may differ from the queries' and keys', as multi-latent attention's does), and returns the
attention output of its queries over the whole sequence's keys, ``[b, hq, s / cp, dv]``:

* ``p2p``: ring attention (``ring.py``): key/value blocks go round the cp ranks, overlapped with compute.
* ``all_gather``: keys and values are all-gathered along the sequence (Llama 3's choice; memory of the whole
  sequence's K/V per layer, one collective), their gradients reduce-scattered back.
* ``a2a``: an all-to-all turns sequence shards into head shards (DeepSpeed Ulysses): each rank then holds the whole
  sequence for ``h / cp`` heads, attends locally, and a second all-to-all turns the output back. Heads (query and
  key/value) must divide by cp.
* ``a2a+p2p``: the all-to-all inside groups of ``--hierarchical-context-parallel-sizes``' first size, then a ring
  across those groups (Megatron's hierarchical cp): the all-to-all's bandwidth inside a node, the ring across.

Every mode runs the blockwise core (``model/blockwise_attention.py``) on global positions and document ids, so it
computes exactly single-process causal, sliding-window or packed-document attention and skips the masked tiles
(tiles of at most the core's block size inside each of the ``2 cp`` chunks). Attention dropout drops a pair by a
hash of one seed and the pair (sample, head, positions), so the masks do not depend on which step or rank computes
it; the all-to-all modes offset the seed by their slice of the heads (``dropout_seed_for_heads``), so every mode
drops the pairs one process's blockwise core drops.
"""

from __future__ import annotations

import torch

from megatron_like import collectives as comm
from megatron_like.model.blockwise_attention import DEFAULT_BLOCK_SIZE, blockwise_attention, dropout_seed_for_heads
from megatron_like.model.context_parallel.layout import cp_positions
from megatron_like.model.context_parallel.ring import Ring, ring_attention
from megatron_like.parallel_state import ParallelState


class _GatherSequence(torch.autograd.Function):
    """Forward: all-gather ``[b, h, s_local, d]`` along the sequence over ``group``; backward: reduce-scatter."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.all_gather_along_dim(x, group, dim=2)

    @staticmethod
    def backward(ctx, grad):
        return comm.reduce_scatter_along_dim(grad, ctx.group, dim=2), None


def _all_to_all_equal(x: torch.Tensor, group: comm.Group) -> torch.Tensor:
    """``x [n, ...]``: row j to rank j of the n-rank ``group``; returns ``[n, ...]`` whose row j came from rank j."""
    n = x.shape[0]
    rows = x.reshape(n, -1).contiguous()
    return comm.all_to_all(rows, [1] * n, [1] * n, group).view_as(x)


def sequence_to_heads(x: torch.Tensor, group: comm.Group) -> torch.Tensor:
    """``[b, h, s, d]`` (this rank's sequence shard, all heads) -> ``[b, h / n, n s, d]`` (every rank's shards in
    group order, this rank's n-th of the heads)."""
    n = comm.group_size(group)
    b, h, s, d = x.shape
    parts = x.view(b, n, h // n, s, d).transpose(0, 1)  # (n, b, h / n, s, d): head group j goes to rank j
    received = _all_to_all_equal(parts, group)  # (n, b, h / n, s, d): sequence shard j from rank j
    return received.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def heads_to_sequence(x: torch.Tensor, group: comm.Group) -> torch.Tensor:
    """The inverse of :func:`sequence_to_heads`: ``[b, h / n, n s, d]`` -> ``[b, h, s, d]``."""
    n = comm.group_size(group)
    b, hn, ns, d = x.shape
    parts = x.view(b, hn, n, ns // n, d).permute(2, 0, 1, 3, 4)  # (n, b, h / n, s, d): shard j goes to rank j
    received = _all_to_all_equal(parts, group)  # (n, b, h / n, s, d): head group j from rank j
    return received.transpose(0, 1).reshape(b, n * hn, ns // n, d)


class _SequenceToHeads(torch.autograd.Function):
    """:func:`sequence_to_heads` whose backward is :func:`heads_to_sequence` (and the reverse when ``inverse``)."""

    @staticmethod
    def forward(ctx, x, group, inverse):
        ctx.group, ctx.inverse = group, inverse
        return (heads_to_sequence if inverse else sequence_to_heads)(x, group)

    @staticmethod
    def backward(ctx, grad):
        return (sequence_to_heads if ctx.inverse else heads_to_sequence)(grad.contiguous(), ctx.group), None, None


def _group_positions(seq_length: int, cp_size: int, cp_ranks: range, device: torch.device) -> torch.Tensor:
    """Global positions of the tokens of these cp ranks, concatenated in their order."""
    return torch.cat([cp_positions(seq_length, cp_size, r, device) for r in cp_ranks])


def _member_documents(every: torch.Tensor | None, cp_size: int, members: int) -> list[torch.Tensor] | None:
    """Split the cp ranks' document ids ``[b, s]`` (concatenated in cp rank order) into ``members`` consecutive
    groups of cp ranks (the ring members of a2a+p2p; one per cp rank for p2p)."""
    return None if every is None else list(every.chunk(members, dim=1))


def _head_slice_seed(seed: int, q: torch.Tensor, a2a_group: comm.Group) -> int:
    """The dropout seed of this rank's slice of the heads after the all-to-all, ``q [b, h / n, s, d]``: its heads
    draw the masks the same heads draw in one process (slice j of the heads lives on rank j of the group)."""
    return dropout_seed_for_heads(seed, comm.group_rank(a2a_group) * q.shape[1])


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ps: ParallelState, *,
                               window_left: int | None = None, causal: bool = True, dropout_p: float = 0.0,
                               softmax_scale: float | None = None, document_ids: torch.Tensor | None = None
                               ) -> torch.Tensor:
    """This cp rank's attention output ``[b, hq, s / cp, dv]`` over the whole sequence, by ``ps.cp_comm_type``.

    q ``[b, hq, s / cp, d]``, k ``[b, hkv, s / cp, d]``, v ``[b, hkv, s / cp, dv]``: this rank's two sequence chunks
    (``layout.py``); ``softmax_scale`` None: ``1 / sqrt(d)``;
    ``document_ids`` int64 ``[b, s / cp]`` of the same tokens (packed documents; None: one sequence per sample).
    With ``dropout_p`` the seed is drawn from the caller's RNG stream (the same on the cp ranks of one tp rank).
    """
    cp, mode = ps.cp_size, ps.cp_comm_type
    seq_length = q.shape[2] * cp
    # Tiles of at most the core's block size (a tile's scores are the transient memory of each step); tiles inside
    # one chunk are contiguous in position, so block_plan's bounds skip exactly the masked ones.
    tile = min(seq_length // (2 * cp), DEFAULT_BLOCK_SIZE)
    device = q.device
    mine = cp_positions(seq_length, cp, ps.cp_rank, device)
    every = _group_positions(seq_length, cp, range(cp), device)
    # Document ids are small ([b, s] int64): every rank gathers them all once, in cp rank order like `every`.
    all_documents = None if document_ids is None else comm.all_gather_along_dim(document_ids, ps.cp_group, dim=1)
    seed = int(torch.randint(0, 1 << 62, (1,), device=device)) if dropout_p > 0 else 0
    options = dict(window_left=window_left, causal=causal, softmax_scale=softmax_scale, dropout_p=dropout_p,
                   dropout_seed=seed, block_size=tile)
    if mode == "all_gather":
        k_all, v_all = _GatherSequence.apply(k, ps.cp_group), _GatherSequence.apply(v, ps.cp_group)
        return blockwise_attention(q, k_all, v_all, q_positions=mine, k_positions=every, q_documents=document_ids,
                                   k_documents=all_documents, **options)[0]
    if mode == "a2a":
        q, k, v = (_SequenceToHeads.apply(t, ps.cp_group, False) for t in (q, k, v))
        options["dropout_seed"] = _head_slice_seed(seed, q, ps.cp_group)
        out = blockwise_attention(q, k, v, q_positions=every, k_positions=every, q_documents=all_documents,
                                  k_documents=all_documents, **options)[0]
        return _SequenceToHeads.apply(out, ps.cp_group, True)
    if mode in ("p2p", "a2a+p2p"):
        a2a_group = ps.cp_a2a_group if mode == "a2a+p2p" else None
        a2a = comm.group_size(a2a_group)
        if a2a > 1:
            q, k, v = (_SequenceToHeads.apply(t, a2a_group, False) for t in (q, k, v))
            seed = _head_slice_seed(seed, q, a2a_group)
        members = cp // a2a  # ring member m holds the tokens of cp ranks m * a2a .. (m + 1) * a2a - 1
        ring = Ring(
            global_ranks=ps.cp_ring_global_ranks if mode == "a2a+p2p" else ps.cp_global_ranks,
            index=ps.cp_rank // a2a,
            positions=list(every.chunk(members)),
            tile=tile,
            documents=_member_documents(all_documents, cp, members),
        )
        out = ring_attention(q, k, v, ring, window_left=window_left, causal=causal, softmax_scale=softmax_scale,
                             dropout_p=dropout_p, dropout_seed=seed)
        return _SequenceToHeads.apply(out, a2a_group, True) if a2a > 1 else out
    raise ValueError(f"unknown --cp-comm-type {mode!r}")
