"""Tokens sorted by expert and back, with index ops only (no Python loop over tokens).

``permute`` lists, expert by expert, the tokens routed to it (in token order within an expert), so each
expert's tokens are one contiguous block; ``unpermute`` sums every token's expert outputs back into its row,
weighted by the router's probabilities. ``sort_chunks`` regroups blocks received from several ranks
(source-major -> expert-major) for the all-to-all dispatcher.
"""

from __future__ import annotations

import torch


def permute(tokens: torch.Tensor, routing_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``tokens [T, h]``, ``routing_map [T, E]`` bool -> ``permuted [N, h]`` (N routed pairs, expert-major),
    ``token_index [N]`` (the row each came from) and ``tokens_per_expert [E]`` (long)."""
    num_tokens = routing_map.shape[0]
    by_expert = routing_map.t()  # [E, T]: row e marks the tokens of expert e
    token_index = torch.arange(num_tokens, device=tokens.device).expand_as(by_expert).masked_select(by_expert)
    return tokens.index_select(0, token_index), token_index, by_expert.sum(dim=1)


def permuted_probs(probs: torch.Tensor, routing_map: torch.Tensor) -> torch.Tensor:
    """The router weight of each permuted row ``[N]`` (same order as :func:`permute`)."""
    return probs.t().masked_select(routing_map.t())


def unpermute(expert_output: torch.Tensor, token_index: torch.Tensor, weights: torch.Tensor,
              num_tokens: int) -> torch.Tensor:
    """``sum_k weight_k * expert_output_k`` per token: ``[N, h]`` -> ``[T, h]`` in fp32 (rows no expert took are 0)."""
    weighted = expert_output.float() * weights[:, None]
    out = torch.zeros(num_tokens, expert_output.shape[1], dtype=torch.float32, device=expert_output.device)
    return out.index_add(0, token_index, weighted)


def sort_chunks(x: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows arranged as ``counts [R, C]`` blocks in row-major order (R sources, C experts) -> column-major
    (expert by expert, sources in order within one). Returns the sorted rows and the index used (to undo it
    with :func:`unsort_chunks`)."""
    sizes = counts.reshape(-1)
    starts = torch.cumsum(sizes, 0) - sizes
    order = torch.arange(sizes.numel(), device=sizes.device).view(counts.shape).t().reshape(-1)
    sizes_out, starts_in = sizes[order], starts[order]
    starts_out = torch.cumsum(sizes_out, 0) - sizes_out
    within = torch.arange(x.shape[0], device=x.device) - torch.repeat_interleave(starts_out, sizes_out)
    index = torch.repeat_interleave(starts_in, sizes_out) + within
    return x.index_select(0, index), index


def unsort_chunks(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Undo :func:`sort_chunks`: row ``i`` of ``x`` goes back to row ``index[i]``."""
    return torch.zeros_like(x).index_copy(0, index, x)
