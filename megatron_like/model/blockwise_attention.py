"""Blockwise attention: online softmax over key blocks, skipping the blocks that no query may see.

One core serves three callers: the sliding window (``--window-size``), packed documents
(``--reset-attention-mask``) and context parallelism's ring steps. Which query may see which key is computed from
token positions and document ids, never from an ``[s, s]`` mask, so a block pair is skipped when no pair in it is
allowed and compute follows the allowed pairs: a window of w over s tokens costs about ``s * w``, documents of
length L about ``s * L``.

The three primitives work on one (query block, key block) pair and are what a ring step calls:

- :func:`attention_block_forward` returns the block's softmax-normalised output and its log-sum-exp (lse);
- :func:`merge_partials` merges two such partial results (the log-sum-exp rescale of flash-attention);
- :func:`attention_block_backward` returns one block pair's share of dq, dk, dv given the *merged* (global)
  output and lse (flash-attention's backward: ``D = rowsum(dO * O)``, ``P = exp(S - lse)``,
  ``dS = P * (dP - D)``), so a ring sums the shares of every block pair.

:func:`blockwise_attention` is the single-process attention built from them (an autograd Function that tiles the
queries and keys and loops over the allowed tiles). Everything here runs in plain PyTorch matmuls; half-precision
inputs are computed in float32. The value head dim may differ from the query/key head dim (multi-latent
attention): scores contract over q's and k's features, the output over v's, so nothing is padded.

The allowed pairs: key ``j`` is visible to query ``i`` when ``k_pos[j] <= q_pos[i]`` (``causal``),
``k_pos[j] >= q_pos[i] - window_left`` (a window: the query and the ``window_left`` keys before it, flash-attention's
``window_size=(window_left, 0)``; ``--window-size`` LEFT), and ``k_doc[b, j] == q_doc[b, i]`` (documents).
A query with no visible key gets output 0 and lse ``-inf`` (never NaN); its gradients are 0.

Attention dropout (``dropout_p``) drops the pair (sample, head, query position, key position) when a hash of it and
``dropout_seed`` falls below ``dropout_p`` (:func:`dropout_keep`): the mask depends on the pair alone, not on how the
queries and keys are cut into blocks or spread over ranks, and the backward rebuilds it from the seed.
"""

from __future__ import annotations

import math

import torch

NEG_INF = float("-inf")
DEFAULT_BLOCK_SIZE = 256
_HASH_BITS = 24  # resolution of the dropout's uniform draw: 1 / 16.7 M


def _signed(value: int) -> int:
    """A 64-bit constant as torch's int64 holds it (two's complement)."""
    return value - (1 << 64) if value >= 1 << 63 else value


_MIX_1, _MIX_2 = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)  # splitmix64's finalizer
_STRIDES = [_signed(c) for c in (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x27D4EB2F165667C5)]


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` keeps the sign)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def dropout_keep(seed: int, batch: int, heads: int, q_positions: torch.Tensor, k_positions: torch.Tensor,
                 dropout_p: float) -> torch.Tensor:
    """bool ``[batch, heads, sq, sk]``: True where attention dropout keeps the pair (probability ``1 - dropout_p``).

    Each pair's draw is splitmix64 of ``seed`` and its (sample, head, query position, key position), so the same
    pair gets the same draw in any block of any rank."""
    device = q_positions.device
    x = (torch.arange(batch, device=device).view(-1, 1, 1, 1) * _STRIDES[0]
         + torch.arange(heads, device=device).view(1, -1, 1, 1) * _STRIDES[1]
         + q_positions.view(1, 1, -1, 1) * _STRIDES[2] + k_positions.view(1, 1, 1, -1) * _STRIDES[3] + seed)
    x = (x ^ _shift_right(x, 30)) * _MIX_1
    x = (x ^ _shift_right(x, 27)) * _MIX_2
    x = x ^ _shift_right(x, 31)
    return _shift_right(x, 64 - _HASH_BITS) >= round(dropout_p * (1 << _HASH_BITS))


def dropout_seed_for_heads(seed: int, head_offset: int) -> int:
    """The seed under which local query head ``h`` draws the dropout mask of head ``head_offset + h`` under
    ``seed`` (the hash's input is linear in the head index: the offset folds into the seed). For a rank that holds
    a slice of the heads, such as the all-to-all modes of context parallelism."""
    return _signed((seed + head_offset * _STRIDES[1]) % (1 << 64))


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the scores, softmax and lse are computed in: float32 for half types, else ``dtype`` itself."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def allowed_pairs(q_positions: torch.Tensor, k_positions: torch.Tensor, q_documents: torch.Tensor | None,
                  k_documents: torch.Tensor | None, window_left: int | None, causal: bool) -> torch.Tensor | None:
    """bool ``[b or 1, sq, sk]`` (True = the query may see the key), or None when every pair is allowed.

    ``q_positions`` ``[sq]``, ``k_positions`` ``[sk]`` int64 global token positions; ``q_documents`` ``[b, sq]``,
    ``k_documents`` ``[b, sk]`` int64 document ids or None.
    """
    allowed = None
    if causal or window_left is not None:
        distance = q_positions[:, None] - k_positions[None, :]  # (sq, sk): how far back the key is
        if causal:
            allowed = distance >= 0
        if window_left is not None:
            inside = distance <= window_left
            allowed = inside if allowed is None else allowed & inside
        allowed = allowed.unsqueeze(0)
    if q_documents is not None:
        same_document = q_documents[:, :, None] == k_documents[:, None, :]  # (b, sq, sk)
        allowed = same_document if allowed is None else allowed & same_document
    if allowed is not None and bool(allowed.all()):
        return None
    return allowed


def _grouped(q: torch.Tensor, hkv: int) -> torch.Tensor:
    """q ``[b, hq, s, d]`` -> ``[b, hkv, hq / hkv, s, d]``: the query heads that share each key/value head."""
    b, hq, s, d = q.shape
    if hq % hkv != 0:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} key/value heads")
    return q.view(b, hkv, hq // hkv, s, d)


def _block_scores(q_scaled: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """Masked scores ``[b, hkv, g, sq, sk]`` (-inf where not allowed) of the grouped, scaled queries ``q_scaled``
    ``[b, hkv, g, sq, d]`` (scaling the queries costs ``sq * d`` multiplications, the scores ``sq * sk``)."""
    scores = torch.matmul(q_scaled, k.to(q_scaled.dtype).unsqueeze(2).transpose(-1, -2))
    if allowed is not None:
        scores.masked_fill_(~allowed[:, None, None], NEG_INF)
    return scores


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (rows with no visible key) replaced by 0, so ``exp(-inf - lse)`` is 0, not NaN."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _tile_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_positions: torch.Tensor,
                  k_positions: torch.Tensor, q_documents: torch.Tensor | None, k_documents: torch.Tensor | None,
                  window_left: int | None, causal: bool, softmax_scale: float | None, dropout_p: float,
                  dropout_seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention_block_forward` of one tile, all its scores at once; out in the compute dtype."""
    b, hq, sq, d = q.shape
    dtype = compute_dtype(q.dtype)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    allowed = allowed_pairs(q_positions, k_positions, q_documents, k_documents, window_left, causal)
    scores = _block_scores(_grouped(q.to(dtype) * scale, k.shape[1]), k, allowed)  # (b, hkv, g, sq, sk)
    row_max = scores.amax(dim=-1, keepdim=True)  # -inf on rows with no visible key
    unnormalized = scores.sub_(_finite(row_max)).exp_()  # in place: the scores are not needed any more
    row_sum = unnormalized.sum(dim=-1, keepdim=True)  # 0 on rows with no visible key (their output stays 0)
    if dropout_p > 0:
        keep = _grouped(dropout_keep(dropout_seed, b, hq, q_positions, k_positions, dropout_p), k.shape[1])
        unnormalized = unnormalized.masked_fill(~keep, 0.0).div_(1.0 - dropout_p)  # the sum above stays undropped
    out = torch.matmul(unnormalized, v.to(dtype).unsqueeze(2)) / row_sum.clamp_min(torch.finfo(dtype).tiny)
    lse = (row_max + torch.log(row_sum)).squeeze(-1)  # -inf + log 0 = -inf, never NaN
    return out.reshape(b, hq, sq, v.shape[-1]), lse.reshape(b, hq, sq)


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attentions of the same queries over disjoint key sets: ``(out, lse)``.

    out ``[b, h, s, d]``, lse ``[b, h, s]``. Each partial output is weighted by ``exp(lse_part - lse)``, its share of
    the merged softmax denominator; rows where both lse are -inf stay out 0, lse -inf. The output has out_a's dtype
    and is combined in lse's dtype.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    finite = _finite(lse)
    weight_a = torch.exp(lse_a - finite)[..., None]
    weight_b = torch.exp(lse_b - finite)[..., None]
    out = weight_a * out_a.to(lse.dtype) + weight_b * out_b.to(lse.dtype)
    return out.to(out_a.dtype), lse


def _tile_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   grad_out: torch.Tensor, *, q_positions: torch.Tensor, k_positions: torch.Tensor,
                   q_documents: torch.Tensor | None, k_documents: torch.Tensor | None, window_left: int | None,
                   causal: bool, softmax_scale: float | None, dropout_p: float, dropout_seed: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`attention_block_backward` of one tile, all its scores at once."""
    b, hq, sq, d = q.shape
    hkv = k.shape[1]
    dtype = compute_dtype(q.dtype)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    allowed = allowed_pairs(q_positions, k_positions, q_documents, k_documents, window_left, causal)
    q_scaled = _grouped(q.to(dtype) * scale, hkv)
    scores = _block_scores(q_scaled, k, allowed)  # (b, hkv, g, sq, sk)
    lse_g = _grouped(_finite(lse.to(dtype)).unsqueeze(-1), hkv)  # (b, hkv, g, sq, 1)
    probs = scores.sub_(lse_g).exp_()  # the merged softmax's probabilities of this block's keys (in place)
    grad_out_g = _grouped(grad_out.to(dtype), hkv)
    delta = (grad_out_g * _grouped(out.to(dtype), hkv)).sum(-1, keepdim=True)  # D = rowsum(dO * O)
    grad_probs = torch.matmul(grad_out_g, v.to(dtype).unsqueeze(2).transpose(-1, -2))  # dP (b, hkv, g, sq, sk)
    dropped_probs = probs
    if dropout_p > 0:  # out used P * keep / (1 - p): so do dV and dP
        keep = _grouped(dropout_keep(dropout_seed, b, hq, q_positions, k_positions, dropout_p), hkv)
        dropped_probs = probs.masked_fill(~keep, 0.0).div_(1.0 - dropout_p)
        grad_probs.masked_fill_(~keep, 0.0).div_(1.0 - dropout_p)
    dv = torch.matmul(dropped_probs.transpose(-1, -2), grad_out_g).sum(2)
    grad_scores = grad_probs.sub_(delta).mul_(probs)  # dS = P * (dP - D), in place; the scale goes on dq, dk
    dq = (torch.matmul(grad_scores, k.to(dtype).unsqueeze(2)) * scale).reshape(b, hq, sq, d)
    dk = torch.matmul(grad_scores.transpose(-1, -2), q_scaled).sum(2)
    return dq, dk, dv


def block_plan(q_positions: torch.Tensor, k_positions: torch.Tensor, q_documents: torch.Tensor | None,
               k_documents: torch.Tensor | None, window_left: int | None, causal: bool, block_q: int, block_k: int
               ) -> list[tuple[slice, list[slice]]]:
    """The tiles worth computing: for each query block, the key blocks that may hold an allowed pair.

    A key block is skipped when its smallest position is after the query block's largest (causal), its largest
    is before the query block's smallest minus ``window_left`` (window), or, in every sample, the document-id
    ranges of the two blocks do not meet. These bounds are necessary conditions only, so a kept tile may still
    hold no allowed pair (its rows then merge as -inf, a no-op); no tile with an allowed pair is ever skipped.
    """
    sq, sk = q_positions.shape[0], k_positions.shape[0]
    q_starts, k_starts = range(0, sq, block_q), range(0, sk, block_k)

    def block_bounds(values: torch.Tensor, starts: range, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Min and max of ``values`` ``[..., s]`` over each block: two ``[..., blocks]`` tensors."""
        blocks = [values[..., start:start + size] for start in starts]
        return (torch.stack([blk.amin(-1) for blk in blocks], -1), torch.stack([blk.amax(-1) for blk in blocks], -1))

    q_lo, q_hi = block_bounds(q_positions, q_starts, block_q)
    k_lo, k_hi = block_bounds(k_positions, k_starts, block_k)
    keep = torch.ones(len(q_starts), len(k_starts), dtype=torch.bool, device=q_positions.device)
    if causal:
        keep &= k_lo[None, :] <= q_hi[:, None]
    if window_left is not None:
        keep &= k_hi[None, :] >= q_lo[:, None] - window_left
    if q_documents is not None:
        qd_lo, qd_hi = block_bounds(q_documents, q_starts, block_q)  # (b, q blocks)
        kd_lo, kd_hi = block_bounds(k_documents, k_starts, block_k)  # (b, k blocks)
        meet = (kd_lo[:, None, :] <= qd_hi[:, :, None]) & (kd_hi[:, None, :] >= qd_lo[:, :, None])
        keep &= meet.any(0)
    keep = keep.tolist()
    return [
        (slice(q_start, q_start + block_q),
         [slice(k_start, k_start + block_k) for kb, k_start in enumerate(k_starts) if keep[qb][kb]])
        for qb, q_start in enumerate(q_starts)
    ]


def _tile_masking(q_slice: slice, k_slice: slice, q_positions: torch.Tensor, k_positions: torch.Tensor,
                  q_documents: torch.Tensor | None, k_documents: torch.Tensor | None) -> dict:
    """The keyword arguments of one tile's block functions: its positions and document ids."""
    return dict(q_positions=q_positions[q_slice], k_positions=k_positions[k_slice],
                q_documents=None if q_documents is None else q_documents[:, q_slice],
                k_documents=None if k_documents is None else k_documents[:, k_slice])


def attention_block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_positions: torch.Tensor,
                            k_positions: torch.Tensor, q_documents: torch.Tensor | None = None,
                            k_documents: torch.Tensor | None = None, window_left: int | None = None,
                            causal: bool = True, softmax_scale: float | None = None, dropout_p: float = 0.0,
                            dropout_seed: int = 0, block_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query block over one key block: ``(out, lse)``.

    q ``[b, hq, sq, d]``, k ``[b, hkv, sk, d]``, v ``[b, hkv, sk, dv]`` (grouped-query attention: hq a multiple of
    hkv, query head ``h`` reads key/value head ``h // (hq / hkv)``; the value head dim ``dv`` may differ from the
    query/key one, as multi-latent attention's does). Returns out ``[b, hq, sq, dv]`` in q's dtype (the softmax over
    this block's keys only) and lse ``[b, hq, sq]`` in float32 (float64 for float64 inputs); rows with no visible
    key give out 0 and lse -inf. Merge blocks with :func:`merge_partials`. With ``dropout_p`` the output drops the
    pairs :func:`dropout_keep` drops (and scales the rest by ``1 / (1 - dropout_p)``); lse is that of the undropped
    softmax, as flash-attention's.

    ``block_size``: cut the queries and keys into tiles of that many tokens, skip the tiles :func:`block_plan` rules
    out and merge the rest (a ring step's big block pair then holds one tile's scores at a time and costs only its
    allowed tiles); None: the whole block pair is one tile.
    """
    options = dict(window_left=window_left, causal=causal, softmax_scale=softmax_scale, dropout_p=dropout_p,
                   dropout_seed=dropout_seed)
    if block_size is None:
        out, lse = _tile_forward(q, k, v, q_positions=q_positions, k_positions=k_positions, q_documents=q_documents,
                                 k_documents=k_documents, **options)
        return out.to(q.dtype), lse
    b, hq, sq, _ = q.shape
    # Laid out sequence first, as SDPA lays out its output: the model's merge of the heads into [s, b, h] is then
    # a view, not a copy kept for backward by the projection after it.
    out = q.new_zeros(sq, b, hq, v.shape[-1], dtype=compute_dtype(q.dtype)).permute(1, 2, 0, 3)
    lse = q.new_full((b, hq, sq), NEG_INF, dtype=out.dtype)
    plan = block_plan(q_positions, k_positions, q_documents, k_documents, window_left, causal, block_size, block_size)
    for q_slice, k_slices in plan:
        out_q, lse_q = out[:, :, q_slice], lse[:, :, q_slice]
        for k_slice in k_slices:
            part, part_lse = _tile_forward(
                q[:, :, q_slice], k[:, :, k_slice], v[:, :, k_slice],
                **_tile_masking(q_slice, k_slice, q_positions, k_positions, q_documents, k_documents), **options,
            )
            out_q, lse_q = merge_partials(out_q, lse_q, part, part_lse)
        out[:, :, q_slice], lse[:, :, q_slice] = out_q, lse_q
    return out.to(q.dtype), lse


def attention_block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                             lse: torch.Tensor, grad_out: torch.Tensor, *, q_positions: torch.Tensor,
                             k_positions: torch.Tensor, q_documents: torch.Tensor | None = None,
                             k_documents: torch.Tensor | None = None, window_left: int | None = None,
                             causal: bool = True, softmax_scale: float | None = None, dropout_p: float = 0.0,
                             dropout_seed: int = 0, block_size: int | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block pair's share of the attention gradients: ``(dq, dk, dv)``.

    ``out`` ``[b, hq, sq, dv]`` and ``lse`` ``[b, hq, sq]`` are those of the attention over *all* key blocks (merged),
    ``grad_out`` its gradient; the other arguments are as in :func:`attention_block_forward`. Summing the shares over
    every key block gives the exact gradients. Returns dq ``[b, hq, sq, d]``, dk ``[b, hkv, sk, d]`` and dv
    ``[b, hkv, sk, dv]`` in the compute dtype (float32 for half inputs), so sums over blocks keep their precision;
    cast after summing.
    ``block_size``: tiled as in :func:`attention_block_forward`.
    """
    options = dict(window_left=window_left, causal=causal, softmax_scale=softmax_scale, dropout_p=dropout_p,
                   dropout_seed=dropout_seed)
    if block_size is None:
        return _tile_backward(q, k, v, out, lse, grad_out, q_positions=q_positions, k_positions=k_positions,
                              q_documents=q_documents, k_documents=k_documents, **options)
    dtype = compute_dtype(q.dtype)
    dq, dk, dv = (torch.zeros_like(t, dtype=dtype) for t in (q, k, v))
    plan = block_plan(q_positions, k_positions, q_documents, k_documents, window_left, causal, block_size, block_size)
    for q_slice, k_slices in plan:
        for k_slice in k_slices:
            dq_part, dk_part, dv_part = _tile_backward(
                q[:, :, q_slice], k[:, :, k_slice], v[:, :, k_slice], out[:, :, q_slice], lse[:, :, q_slice],
                grad_out[:, :, q_slice],
                **_tile_masking(q_slice, k_slice, q_positions, k_positions, q_documents, k_documents), **options,
            )
            dq[:, :, q_slice] += dq_part
            dk[:, :, k_slice] += dk_part
            dv[:, :, k_slice] += dv_part
    return dq, dk, dv


class BlockwiseAttention(torch.autograd.Function):
    """Single-process attention over the allowed tiles; see :func:`blockwise_attention`."""

    @staticmethod
    def forward(ctx, q, k, v, q_positions, k_positions, q_documents, k_documents, window_left, causal,
                softmax_scale, block_size, dropout_p, dropout_seed):
        ctx.options = dict(q_positions=q_positions, k_positions=k_positions, q_documents=q_documents,
                           k_documents=k_documents, window_left=window_left, causal=causal,
                           softmax_scale=softmax_scale, dropout_p=dropout_p, dropout_seed=dropout_seed,
                           block_size=block_size)
        out, lse = attention_block_forward(q, k, v, **ctx.options)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = attention_block_backward(q, k, v, out, lse, grad_out, **ctx.options)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *[None] * 10


def blockwise_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_positions: torch.Tensor | None = None,
                        k_positions: torch.Tensor | None = None, q_documents: torch.Tensor | None = None,
                        k_documents: torch.Tensor | None = None, window_left: int | None = None, causal: bool = True,
                        softmax_scale: float | None = None, block_size: int = DEFAULT_BLOCK_SIZE,
                        dropout_p: float = 0.0, dropout_seed: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q over k, v computing only the tiles that hold an allowed pair: ``(out, lse)``.

    Shapes and masking as :func:`attention_block_forward` (positions default to ``0 .. s - 1``; ``k_documents``
    defaults to ``q_documents`` when the two sequences are the same length). Queries and keys are cut into
    ``block_size`` blocks; tiles that :func:`block_plan` rules out cost nothing. Differentiable in q, k, v; lse is
    returned for callers that merge further and carries no gradient. ``dropout_seed`` None with ``dropout_p > 0``:
    drawn from the device's generator (recompute-safe: the checkpoint restores it).
    """
    if q_positions is None:
        q_positions = torch.arange(q.shape[2], device=q.device)
    if k_positions is None:
        k_positions = torch.arange(k.shape[2], device=k.device)
    if k_documents is None and q_documents is not None and k.shape[2] == q.shape[2]:
        k_documents = q_documents
    if (q_documents is None) != (k_documents is None):
        raise ValueError("document ids must be given for both queries and keys, or for neither")
    if block_size < 1:
        raise ValueError(f"block_size {block_size} must be at least 1")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p {dropout_p} must be in [0, 1)")
    if dropout_p > 0 and dropout_seed is None:
        dropout_seed = int(torch.randint(0, 1 << 62, (1,), device=q.device))
    return BlockwiseAttention.apply(q, k, v, q_positions, k_positions, q_documents, k_documents, window_left,
                                    causal, softmax_scale, block_size, dropout_p, dropout_seed or 0)
