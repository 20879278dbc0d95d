"""Causal attention masks, with or without a sliding window (``--window-size``).

The query at position ``q`` attends to the key at position ``k`` when ``q - window < k <= q``: ``window`` keys,
itself included. That is Hugging Face Mistral's sliding window (``kv_idx > q_idx - sliding_window``) and
Megatron-LM's / flash-attention's ``window_size = (window - 1, 0)``. Training builds the ``[s, s]`` mask only when
the window is shorter than the sequence (else plain causal attention is the same and takes the fast path), or
always under torch.compile / torch.export, whose sequence length may be symbolic;
generation's KV cache builds the rows of its new queries over every cached key (``inference/kv_cache.py``).
"""

from __future__ import annotations

from functools import lru_cache

import torch


def causal_mask(first_query: int, queries: int, keys: int, window: int | None, device: torch.device) -> torch.Tensor:
    """bool ``[queries, keys]``, True = attend: rows are the queries at positions ``first_query ..
    first_query + queries - 1``, columns the keys at positions ``0 .. keys - 1``; ``window`` None = no window."""
    q = torch.arange(first_query, first_query + queries, device=device)[:, None]
    k = torch.arange(keys, device=device)[None, :]
    allowed = k <= q
    if window is not None:
        allowed &= k > q - window
    return allowed


def sliding_window_mask(seq_length: int, window: int, device: torch.device) -> torch.Tensor:
    """bool ``[s, s]`` (True = attend) of a whole training sequence, built once per (s, window, device) and reused
    by every layer and step; callers must not write into it."""
    if torch.compiler.is_compiling():
        return causal_mask(0, seq_length, seq_length, window, device)
    return _cached_mask(seq_length, window, torch.device(device))


@lru_cache(maxsize=8)
def _cached_mask(seq_length: int, window: int, device: torch.device) -> torch.Tensor:
    with torch.inference_mode(False):  # a normal tensor even if first asked for under inference_mode (evaluation)
        return causal_mask(0, seq_length, seq_length, window, device)
