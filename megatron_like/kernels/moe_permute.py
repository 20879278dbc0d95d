"""Token permutation for mixture-of-experts layers: group the routed copies of tokens by expert and back.

``permute`` sorts the ``T * topk`` (token, choice) slots by expert with one stable ``argsort`` and
gathers the token rows with ``index_select``; ``unpermute`` weights each expert output row by its router
probability and sums the copies of a token with ``index_add``. No Python loop over tokens or experts,
and autograd differentiates both (the backward of a gather is a scatter-add and vice versa), so no
custom kernel is needed: the two are memory-bound copies of ``T * topk * h`` values, small next to the
expert GEMMs (``benchmarks/grouped_gemm.py`` times them). The stable sort keeps the tokens of one expert
in token order, so the layout is deterministic and the same on every rank and run.

An expert index of ``-1`` marks a dropped slot (capacity-based token dropping): it gets no row, and its
token receives nothing from that choice.
"""

from __future__ import annotations

import torch

DROPPED = -1
"""The expert index of a slot that was dropped (no expert processes it)."""


def check_routing(expert_indices: torch.Tensor, num_experts: int, num_tokens: int | None = None) -> None:
    """Raise a one-line ValueError when ``expert_indices`` is not ``[T, topk]`` int64 in ``[-1, num_experts)``."""
    if expert_indices.dim() != 2 or expert_indices.dtype != torch.int64:
        raise ValueError(f"moe permute: expert_indices must be an int64 [T, topk] tensor, got {expert_indices.dtype} "
                         f"{tuple(expert_indices.shape)}")
    if num_tokens is not None and expert_indices.shape[0] != num_tokens:
        raise ValueError(f"moe permute: expert_indices has {expert_indices.shape[0]} rows but there are {num_tokens} "
                         "tokens: route every token")
    if expert_indices.numel():
        low, high = int(expert_indices.min()), int(expert_indices.max())
        if low < DROPPED or high >= num_experts:
            raise ValueError(f"moe permute: expert indices span [{low}, {high}] but must lie in [-1, {num_experts}) "
                             "(-1 = dropped)")


def permute(tokens: torch.Tensor, expert_indices: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(permuted [R, h], row_map [R])``: token copies grouped by expert, in expert order.

    ``tokens [T, h]``; ``expert_indices [T, topk]`` (int64, ``-1`` = dropped). Row ``r`` of ``permuted`` is
    ``tokens[row_map[r] // topk]`` and ``row_map[r] = t * topk + j`` names the slot (token ``t``, choice
    ``j``) it came from; ``R = T * topk`` minus the dropped slots. Within an expert, rows keep token order.
    Use :func:`tokens_per_expert` for the group sizes :func:`~megatron_like.kernels.grouped_gemm` needs.
    """
    if tokens.dim() != 2:
        raise ValueError(f"moe permute: tokens must be [T, h], got {tuple(tokens.shape)}")
    check_routing(expert_indices, num_experts, tokens.shape[0])
    topk = expert_indices.shape[1]
    flat = expert_indices.reshape(-1)
    order = torch.argsort(flat, stable=True)  # dropped slots (-1) sort first
    dropped = int((flat == DROPPED).sum()) if flat.numel() else 0
    row_map = order[dropped:]
    return tokens.index_select(0, torch.div(row_map, topk, rounding_mode="floor")), row_map


def unpermute(permuted: torch.Tensor, row_map: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Return ``[T, h]``: each token's expert outputs weighted by ``probs`` and summed.

    ``permuted [R, h]`` and ``row_map [R]`` as :func:`permute` returned them (``permuted`` may be the
    experts' output, with another hidden size); ``probs [T, topk]`` the router weights. Weighting and the
    sum over a token's copies run in the promoted dtype of ``permuted`` and ``probs`` (fp32 for bf16
    activations with fp32 probs), rounded to ``permuted``'s dtype once. Dropped slots contribute zero.
    """
    if permuted.dim() != 2 or row_map.shape != (permuted.shape[0],):
        raise ValueError(f"moe unpermute: permuted must be [R, h] with row_map [R], got {tuple(permuted.shape)} and "
                         f"{tuple(row_map.shape)}")
    if probs.dim() != 2:
        raise ValueError(f"moe unpermute: probs must be [T, topk], got {tuple(probs.shape)}")
    num_tokens, topk = probs.shape
    weights = probs.reshape(-1).index_select(0, row_map)
    weighted = permuted * weights.unsqueeze(-1)
    out = weighted.new_zeros(num_tokens, permuted.shape[1])
    out = out.index_add(0, torch.div(row_map, topk, rounding_mode="floor"), weighted)
    return out.to(permuted.dtype)


def tokens_per_expert(expert_indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Return the CPU int64 ``[E]`` row counts of :func:`permute`'s groups (dropped slots excluded)."""
    flat = expert_indices.reshape(-1)
    counts = torch.bincount(flat[flat != DROPPED], minlength=num_experts)
    return counts.cpu()
