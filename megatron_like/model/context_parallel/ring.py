"""Ring attention (``--cp-comm-type p2p``): key/value blocks travel around the context-parallel ranks.

Each of the ``n`` ranks of a ring holds its queries, keys and values ``[b, h, s_local, d]``. At step ``t`` a rank
attends over the keys and values of ring member ``me - t`` while it already sends them on to ``me + 1`` and
receives those of ``me - t - 1`` (one batched isend/irecv, waited for after the block's compute): after ``n`` steps
it has seen every key. Partial results merge by log-sum-exp (``blockwise_attention.merge_partials``).

Causal work is skipped tile by tile: the tiles are the sequence's ``2 cp`` chunks (each contiguous in position),
and a (query chunk, key chunk) pair with no allowed query-key pair (wholly above the diagonal, or outside the
sliding window) is never computed (``blockwise_attention.block_plan``). With the load-balanced layout
(``layout.py``) every rank then computes the same number of tiles.

Backward runs the ring again: the keys and values go round once more, and each block's share of dK/dV travels
with them, accumulated by every rank it passes (flash-attention's backward from the merged output and lse,
``attention_block_backward``), so after ``n`` steps it arrives home complete.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_like import collectives as comm
from megatron_like.model.blockwise_attention import (
    NEG_INF,
    allowed_pairs,
    attention_block_backward,
    attention_block_forward,
    block_plan,
    compute_dtype,
    merge_partials,
)

# Point-to-point tags of the ring's messages, apart from the pipeline's (0, 1) and the ZeRO reduce-scatter's.
_KV_TAG, _DKV_TAG = 0x4350, 0x4351


@dataclass
class Ring:
    """The ranks a ring attention runs over and which tokens each holds.

    Attributes:
        global_ranks: the members' global ranks in ring order (a member sends to the next, receives from the
            previous).
        index: this rank's place in ``global_ranks``.
        positions: each member's global token positions int64 ``[s_local]``, by ring index.
        tile: tile length for skipping: every run of ``tile`` tokens of ``positions`` is contiguous.
    """

    global_ranks: list[int]
    index: int
    positions: list[torch.Tensor]
    tile: int

    def step_source(self, step: int) -> int:
        """Ring index of the member whose keys and values this rank holds at ``step``."""
        return (self.index - step) % len(self.global_ranks)

    @property
    def next_rank(self) -> int:
        return self.global_ranks[(self.index + 1) % len(self.global_ranks)]

    @property
    def previous_rank(self) -> int:
        return self.global_ranks[(self.index - 1) % len(self.global_ranks)]


def ring_step_tiles(ring: Ring, step: int, window_left: int | None, causal: bool) -> list[tuple[slice, list[slice]]]:
    """The (query tile, key tiles) pairs this rank computes at ``step``: the others hold no allowed pair."""
    return block_plan(ring.positions[ring.index], ring.positions[ring.step_source(step)], None, None, window_left,
                      causal, ring.tile, ring.tile)


class TileDropout:
    """Attention dropout of the ring's tiles: each (step, query tile, key tile) draws its keep-mask from a generator
    seeded by one seed per forward (drawn from the caller's RNG stream, so tensor-parallel ranks differ as their
    heads do) plus the tile's index, so backward draws the same masks again without storing them.

    Dropout composes with the log-sum-exp merge: a tile's output ``dropout(P_tile) v`` with ``P_tile`` normalised by
    the tile's own lse is rescaled by ``exp(lse_tile - lse)`` exactly like the undropped one.
    """

    def __init__(self, p: float, device: torch.device, tiles_per_member: int) -> None:
        self.p, self.device, self.tiles = p, device, tiles_per_member
        self.seed = int(torch.randint(0, 2**62, (1,), device=device).item())

    def scaled_keep(self, shape: tuple[int, ...], step: int, q_tile: slice, k_tile: slice, tile: int,
                    dtype: torch.dtype) -> torch.Tensor:
        """``keep / (1 - p)`` ``[b, hq, tq, tk]`` of one tile (0 where dropped)."""
        index = (step * self.tiles + q_tile.start // tile) * self.tiles + k_tile.start // tile
        generator = torch.Generator(device=self.device).manual_seed(self.seed + index)
        keep = torch.rand(shape, generator=generator, device=self.device) >= self.p
        return keep.to(dtype) / (1.0 - self.p)


def _dropout_tile(q: torch.Tensor, k: torch.Tensor, softmax_scale: float | None, mask_options: dict
                  ) -> tuple[torch.Tensor, float, int]:
    """Masked scaled scores ``[b, hq, tq, tk]`` (k's heads repeated for grouped-query attention), the scale and
    the repeat."""
    dtype = compute_dtype(q.dtype)
    repeat = q.shape[1] // k.shape[1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = torch.matmul(q.to(dtype), k.to(dtype).repeat_interleave(repeat, 1).transpose(-1, -2)) * scale
    allowed = allowed_pairs(mask_options["q_positions"], mask_options["k_positions"], None, None,
                            mask_options["window_left"], mask_options["causal"])
    if allowed is not None:
        scores = scores.masked_fill(~allowed[:, None], NEG_INF)
    return scores, scale, repeat


def _finite(lse: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def dropout_tile_forward(q, k, v, keep, softmax_scale, mask_options) -> tuple[torch.Tensor, torch.Tensor]:
    """``attention_block_forward`` with the probabilities multiplied by ``keep`` (``TileDropout.scaled_keep``)."""
    scores, _, repeat = _dropout_tile(q, k, softmax_scale, mask_options)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - _finite(lse)[..., None]) * keep
    return torch.matmul(probs, v.to(probs.dtype).repeat_interleave(repeat, 1)), lse


def dropout_tile_backward(q, k, v, out, lse, grad_out, keep, softmax_scale, mask_options):
    """``attention_block_backward`` of :func:`dropout_tile_forward`: dV = (P keep)^T dO, dP = (dO V^T) keep,
    dS = P (dP - rowsum(dO O)) (the merged ``out`` already holds the dropout)."""
    scores, scale, repeat = _dropout_tile(q, k, softmax_scale, mask_options)
    dtype = scores.dtype
    probs = torch.exp(scores - _finite(lse.to(dtype))[..., None])
    grad_out, v_rep = grad_out.to(dtype), v.to(dtype).repeat_interleave(repeat, 1)
    delta = (grad_out * out.to(dtype)).sum(-1, keepdim=True)
    grad_scores = probs * (torch.matmul(grad_out, v_rep.transpose(-1, -2)) * keep - delta) * scale
    b, hkv, tk, d = k.shape

    def per_kv_head(x: torch.Tensor) -> torch.Tensor:  # [b, hq, tk, d] -> [b, hkv, tk, d]
        return x.view(b, hkv, repeat, tk, d).sum(2)

    dq = torch.matmul(grad_scores, k.to(dtype).repeat_interleave(repeat, 1))
    dk = per_kv_head(torch.matmul(grad_scores.transpose(-1, -2), q.to(dtype)))
    dv = per_kv_head(torch.matmul((probs * keep).transpose(-1, -2), grad_out))
    return dq, dk, dv


def _pass_on(tensor: torch.Tensor, ring: Ring, tag: int) -> tuple[torch.Tensor, list]:
    """Start sending ``tensor`` to the next member and receiving the previous member's into a new tensor."""
    received = torch.empty_like(tensor)
    works = comm.post_p2p([(tensor, ring.next_rank, tag)], [(received, ring.previous_rank, tag)])
    return received, works


def _wait(works: list) -> None:
    for work in works:
        work.wait()


class RingAttention(torch.autograd.Function):
    """q ``[b, hq, s, d]``, k and v ``[b, hkv, s, d]`` -> out ``[b, hq, s, d]``, attending over every ring member's
    keys (see the module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, window_left, causal, softmax_scale, dropout_p):
        b, hq, s, d = q.shape
        dropout = TileDropout(dropout_p, q.device, s // ring.tile) if dropout_p > 0 else None
        q_positions = ring.positions[ring.index]
        out = q.new_zeros(b, hq, s, d, dtype=compute_dtype(q.dtype))
        lse = q.new_full((b, hq, s), NEG_INF, dtype=compute_dtype(q.dtype))
        kv = torch.stack([k, v])  # (2, b, hkv, s, d): one message per step
        n = len(ring.global_ranks)
        for step in range(n):
            if step < n - 1:
                incoming, works = _pass_on(kv, ring, _KV_TAG)  # travels while this block computes
            k_positions = ring.positions[ring.step_source(step)]
            for q_tile, k_tiles in ring_step_tiles(ring, step, window_left, causal):
                out_q, lse_q = out[:, :, q_tile], lse[:, :, q_tile]
                for k_tile in k_tiles:
                    mask = dict(q_positions=q_positions[q_tile], k_positions=k_positions[k_tile],
                                window_left=window_left, causal=causal)
                    q_part, k_part, v_part = q[:, :, q_tile], kv[0][:, :, k_tile], kv[1][:, :, k_tile]
                    if dropout is None:
                        part, part_lse = attention_block_forward(q_part, k_part, v_part, softmax_scale=softmax_scale,
                                                                 **mask)
                    else:
                        keep = dropout.scaled_keep(out_q.shape[:3] + (k_part.shape[2],), step, q_tile, k_tile,
                                                   ring.tile, out.dtype)
                        part, part_lse = dropout_tile_forward(q_part, k_part, v_part, keep, softmax_scale, mask)
                    out_q, lse_q = merge_partials(out_q, lse_q, part, part_lse)
                out[:, :, q_tile], lse[:, :, q_tile] = out_q, lse_q
            if step < n - 1:
                _wait(works)
                kv = incoming
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.window_left, ctx.causal, ctx.softmax_scale, ctx.dropout = (
            ring, window_left, causal, softmax_scale, dropout)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring, dropout = ctx.ring, ctx.dropout
        q_positions = ring.positions[ring.index]
        dq = torch.zeros_like(q, dtype=compute_dtype(q.dtype))
        kv = torch.stack([k, v])
        n = len(ring.global_ranks)
        dkv_works: list = []
        dkv_from_previous = torch.zeros(())  # replaced at step 0 by the block the previous member passes on
        for step in range(n):
            if step < n - 1:
                incoming, kv_works = _pass_on(kv, ring, _KV_TAG)
            k_positions = ring.positions[ring.step_source(step)]
            dkv = torch.zeros_like(kv, dtype=dq.dtype)  # this step's block: (dk, dv)
            for q_tile, k_tiles in ring_step_tiles(ring, step, ctx.window_left, ctx.causal):
                for k_tile in k_tiles:
                    mask = dict(q_positions=q_positions[q_tile], k_positions=k_positions[k_tile],
                                window_left=ctx.window_left, causal=ctx.causal)
                    args = (q[:, :, q_tile], kv[0][:, :, k_tile], kv[1][:, :, k_tile], out[:, :, q_tile],
                            lse[:, :, q_tile], grad_out[:, :, q_tile])
                    if dropout is None:
                        dq_part, dk_part, dv_part = attention_block_backward(*args, softmax_scale=ctx.softmax_scale,
                                                                             **mask)
                    else:
                        keep = dropout.scaled_keep(args[5].shape[:3] + (args[1].shape[2],), step, q_tile, k_tile,
                                                   ring.tile, dq.dtype)
                        dq_part, dk_part, dv_part = dropout_tile_backward(*args, keep, ctx.softmax_scale, mask)
                    dq[:, :, q_tile] += dq_part
                    dkv[0][:, :, k_tile] += dk_part
                    dkv[1][:, :, k_tile] += dv_part
            if step > 0:  # the shares of the members this block visited before: add ours, pass them on
                _wait(dkv_works)
                dkv += dkv_from_previous
            if n == 1:  # a ring of one: nothing travels
                dkv_from_previous = dkv
            else:
                dkv_from_previous, dkv_works = _pass_on(dkv, ring, _DKV_TAG)
            if step < n - 1:
                _wait(kv_works)
                kv = incoming
        _wait(dkv_works)  # our own block's dK/dV, summed over the whole ring, back home
        dk, dv = dkv_from_previous
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring, *, window_left: int | None = None,
                   causal: bool = True, softmax_scale: float | None = None, dropout_p: float = 0.0) -> torch.Tensor:
    """Attention of this rank's queries over every ring member's keys: out ``[b, hq, s_local, d]`` (q's dtype).

    q ``[b, hq, s_local, d]``, k and v ``[b, hkv, s_local, d]`` (grouped-query attention: hq a multiple of hkv);
    masking by the members' global positions (``ring.positions``) as in ``blockwise_attention``; attention dropout
    with probability ``dropout_p`` (:class:`TileDropout`). A ring of one member attends to its own keys only.
    """
    return RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), ring, window_left, causal,
                               softmax_scale, dropout_p)
