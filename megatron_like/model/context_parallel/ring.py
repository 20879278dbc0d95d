"""Ring attention (``--cp-comm-type p2p``): key/value blocks travel around the context-parallel ranks.

Each of the ``n`` members of a ring holds its queries, keys and values ``[b, h, s_local, d]``. At step ``t`` a
member attends over the keys and values of member ``me - t`` while it already sends them on to ``me + 1`` and
receives those of ``me - t - 1`` (one batched isend/irecv, waited for after the block's compute): after ``n`` steps
it has seen every key. Partial results merge by log-sum-exp (``blockwise_attention.merge_partials``).

Causal work is skipped tile by tile: the tiles are the sequence's ``2 cp`` chunks (each contiguous in position),
and a (query chunk, key chunk) pair with no allowed query-key pair (wholly above the diagonal, outside the sliding
window, or in other documents) is never computed (``blockwise_attention.block_plan``, :func:`ring_step_tiles`).
With the load-balanced layout (``layout.py``) every member then computes the same number of tiles.

Backward runs the ring again: the keys and values go round once more, and each block's share of dK/dV travels
with them, accumulated by every member it passes (flash-attention's backward from the merged output and lse,
``attention_block_backward``), so after ``n`` steps it arrives home complete.

Attention dropout: the core drops a pair by a hash of one seed and the pair's (sample, head, positions), so the
masks do not depend on which step or rank computes a block, and backward rebuilds them from the same seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_like import collectives as comm
from megatron_like.model.blockwise_attention import (
    NEG_INF,
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
        documents: each member's packed-document ids int64 ``[b, s_local]``, by ring index (None: one sequence).
    """

    global_ranks: list[int]
    index: int
    positions: list[torch.Tensor]
    tile: int
    documents: list[torch.Tensor] | None = None

    def step_source(self, step: int) -> int:
        """Ring index of the member whose keys and values this rank holds at ``step``."""
        return (self.index - step) % len(self.global_ranks)

    def masking(self, step: int) -> dict:
        """The block functions' positions and document ids for this rank's queries over ``step``'s keys."""
        source = self.step_source(step)
        docs = self.documents
        return dict(q_positions=self.positions[self.index], k_positions=self.positions[source],
                    q_documents=None if docs is None else docs[self.index],
                    k_documents=None if docs is None else docs[source])

    @property
    def next_rank(self) -> int:
        return self.global_ranks[(self.index + 1) % len(self.global_ranks)]

    @property
    def previous_rank(self) -> int:
        return self.global_ranks[(self.index - 1) % len(self.global_ranks)]


def ring_step_tiles(ring: Ring, step: int, window_left: int | None, causal: bool) -> list[tuple[slice, list[slice]]]:
    """The (query tile, key tiles) pairs this rank computes at ``step``: the others hold no allowed pair."""
    masking = ring.masking(step)
    return block_plan(masking["q_positions"], masking["k_positions"], masking["q_documents"], masking["k_documents"],
                      window_left, causal, ring.tile, ring.tile)


def _pass_on(tensor: torch.Tensor, ring: Ring, tag: int) -> tuple[torch.Tensor, list]:
    """Start sending ``tensor`` to the next member and receiving the previous member's into a new tensor."""
    received = torch.empty_like(tensor)
    works = comm.post_p2p([(tensor, ring.next_rank, tag)], [(received, ring.previous_rank, tag)])
    return received, works


def _wait(works: list) -> None:
    for work in works:
        work.wait()


def _split_kv(kv: torch.Tensor, key_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys ``[.., key_dim]`` and values ``[.., rest]`` of a ring message (:func:`_join_kv`)."""
    return kv[..., :key_dim], kv[..., key_dim:]


def _join_kv(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """k ``[b, hkv, s, d]`` and v ``[b, hkv, s, dv]`` as one message ``[b, hkv, s, d + dv]``.

    Joined along the features rather than stacked, so the value head dim may differ from the key head dim
    (multi-latent attention's values are narrower than its keys): padding v to k's width would send, and multiply,
    zeros at every step."""
    return torch.cat([k, v], dim=-1)


class RingAttention(torch.autograd.Function):
    """q ``[b, hq, s, d]``, k ``[b, hkv, s, d]``, v ``[b, hkv, s, dv]`` -> out ``[b, hq, s, dv]``, attending over
    every ring member's keys (see the module docstring). ``options``: the block functions' masking, scale and
    dropout keywords."""

    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, options: dict):
        b, hq, s, d = q.shape
        out = q.new_zeros(b, hq, s, v.shape[-1], dtype=compute_dtype(q.dtype))
        lse = q.new_full((b, hq, s), NEG_INF, dtype=out.dtype)
        kv = _join_kv(k, v)  # one message per step
        n = len(ring.global_ranks)
        for step in range(n):
            if step < n - 1:
                incoming, works = _pass_on(kv, ring, _KV_TAG)  # travels while this block computes
            part, part_lse = attention_block_forward(q, *_split_kv(kv, d), **ring.masking(step), **options,
                                                     block_size=ring.tile)
            out, lse = merge_partials(out, lse, part, part_lse)
            if step < n - 1:
                _wait(works)
                kv = incoming
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.options = ring, options
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring = ctx.ring
        grad_out = grad_out.contiguous()
        dq = torch.zeros_like(q, dtype=compute_dtype(q.dtype))
        key_dim = k.shape[-1]
        kv = _join_kv(k, v)
        n = len(ring.global_ranks)
        dkv_works: list = []
        dkv_from_previous = torch.zeros(())  # replaced at step 0 by the block the previous member passes on
        for step in range(n):
            if step < n - 1:
                incoming, kv_works = _pass_on(kv, ring, _KV_TAG)
            dq_part, dk_part, dv_part = attention_block_backward(
                q, *_split_kv(kv, key_dim), out, lse, grad_out, **ring.masking(step), **ctx.options,
                block_size=ring.tile)
            dq += dq_part
            dkv = _join_kv(dk_part, dv_part)  # this step's block's share
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
        dk, dv = _split_kv(dkv_from_previous, key_dim)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring, *, window_left: int | None = None,
                   causal: bool = True, softmax_scale: float | None = None, dropout_p: float = 0.0,
                   dropout_seed: int = 0) -> torch.Tensor:
    """Attention of this rank's queries over every ring member's keys: out ``[b, hq, s_local, dv]`` (q's dtype).

    q ``[b, hq, s_local, d]``, k ``[b, hkv, s_local, d]``, v ``[b, hkv, s_local, dv]`` (grouped-query attention: hq
    a multiple of hkv; the value head dim may differ, as multi-latent attention's does);
    masking by the members' global positions and document ids (``ring``) as in ``blockwise_attention``; attention
    dropout with probability ``dropout_p`` from ``dropout_seed``. A ring of one member attends to its own keys.
    """
    options = dict(window_left=window_left, causal=causal, softmax_scale=softmax_scale, dropout_p=dropout_p,
                   dropout_seed=dropout_seed)
    return RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), ring, options)
