"""Attention across the context-parallel ranks, the four ways of ``--cp-comm-type`` (Megatron-LM's names).

Each rank holds queries, keys and values of its two sequence chunks, ``[b, h, s / cp, d]`` (``layout.py``), and
returns the attention output of its queries over the whole sequence's keys, ``[b, hq, s / cp, d]``:

* ``p2p``: ring attention (``ring.py``): key/value blocks go round the cp ranks, overlapped with compute.
* ``all_gather``: keys and values are all-gathered along the sequence (Llama 3's choice; memory of the whole
  sequence's K/V per layer, one collective), their gradients reduce-scattered back.
* ``a2a``: an all-to-all turns sequence shards into head shards (DeepSpeed Ulysses): each rank then holds the whole
  sequence for ``h / cp`` heads, attends locally, and a second all-to-all turns the output back. Heads (query and
  key/value) must divide by cp.
* ``a2a+p2p``: the all-to-all inside groups of ``--hierarchical-context-parallel-sizes``' first size, then a ring
  across those groups (Megatron's hierarchical cp): the all-to-all's bandwidth inside a node, the ring across.

Masking always uses global positions, so every mode computes exactly single-process causal (or sliding-window)
attention. With attention dropout (``dropout_p > 0``), the all-gather and all-to-all modes attend with PyTorch's
SDPA over the positional mask (the blockwise core has no dropout); the ring applies its own dropout masks
(``ring.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_like import collectives as comm
from megatron_like.model.blockwise_attention import allowed_pairs, blockwise_attention
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


def _local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor,
                     k_positions: torch.Tensor, tile: int, window_left: int | None, causal: bool, dropout_p: float,
                     softmax_scale: float | None) -> torch.Tensor:
    """Attention of q over k, v at these global positions: the blockwise core (skipping masked tiles), or SDPA
    over the positional mask when attention dropout is on."""
    if dropout_p == 0.0:
        return blockwise_attention(q, k, v, q_positions=q_positions, k_positions=k_positions, window_left=window_left,
                                   causal=causal, softmax_scale=softmax_scale, block_size=tile)[0]
    allowed = allowed_pairs(q_positions, k_positions, None, None, window_left, causal)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=None if allowed is None else allowed[0],
                                          dropout_p=dropout_p, scale=softmax_scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


def _group_positions(seq_length: int, cp_size: int, cp_ranks: range, device: torch.device) -> torch.Tensor:
    """Global positions of the tokens of these cp ranks, concatenated in their order."""
    return torch.cat([cp_positions(seq_length, cp_size, r, device) for r in cp_ranks])


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ps: ParallelState, *,
                               window_left: int | None = None, causal: bool = True, dropout_p: float = 0.0,
                               softmax_scale: float | None = None) -> torch.Tensor:
    """This cp rank's attention output ``[b, hq, s / cp, d]`` over the whole sequence, by ``ps.cp_comm_type``.

    q ``[b, hq, s / cp, d]``, k and v ``[b, hkv, s / cp, d]``: this rank's two sequence chunks (``layout.py``).
    """
    cp, mode = ps.cp_size, ps.cp_comm_type
    seq_length = q.shape[2] * cp
    tile = seq_length // (2 * cp)
    device = q.device
    mine = cp_positions(seq_length, cp, ps.cp_rank, device)
    if mode == "all_gather":
        k_all, v_all = _GatherSequence.apply(k, ps.cp_group), _GatherSequence.apply(v, ps.cp_group)
        every = _group_positions(seq_length, cp, range(cp), device)
        return _local_attention(q, k_all, v_all, mine, every, tile, window_left, causal, dropout_p, softmax_scale)
    if mode == "a2a":
        every = _group_positions(seq_length, cp, range(cp), device)
        q, k, v = (_SequenceToHeads.apply(t, ps.cp_group, False) for t in (q, k, v))
        out = _local_attention(q, k, v, every, every, tile, window_left, causal, dropout_p, softmax_scale)
        return _SequenceToHeads.apply(out, ps.cp_group, True)
    if mode in ("p2p", "a2a+p2p"):
        a2a_group = ps.cp_a2a_group if mode == "a2a+p2p" else None
        a2a = comm.group_size(a2a_group)
        if a2a > 1:
            q, k, v = (_SequenceToHeads.apply(t, a2a_group, False) for t in (q, k, v))
        members = cp // a2a  # ring member m holds the tokens of cp ranks m * a2a .. (m + 1) * a2a - 1
        ring = Ring(
            global_ranks=ps.cp_ring_global_ranks if mode == "a2a+p2p" else ps.cp_global_ranks,
            index=ps.cp_rank // a2a,
            positions=[_group_positions(seq_length, cp, range(m * a2a, (m + 1) * a2a), device) for m in range(members)],
            tile=tile,
        )
        out = ring_attention(q, k, v, ring, window_left=window_left, causal=causal, softmax_scale=softmax_scale,
                             dropout_p=dropout_p)
        return _SequenceToHeads.apply(out, a2a_group, True) if a2a > 1 else out
    raise ValueError(f"unknown --cp-comm-type {mode!r}")
