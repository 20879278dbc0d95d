"""The key/value cache of generation: what ``GPTModel.forward(..., inference_context=cache)`` reads.

Each layer's keys and values live in one preallocated buffer ``[b, ng, max_length, hd]`` (``ng`` =
key/value heads of this tp rank: ``groups / tp`` with grouped-query attention, else ``heads / tp``; the
buffers take the shape of the first keys stored), filled left to right: a prompt of ``s`` tokens fills
``[0, s)`` in one forward (prefill), then every decode step appends one position. Prompts of different
lengths are *left padded* so that every row's next token sits at the same column; ``valid [b, max_length]``
says which columns hold real tokens, and the attention mask keeps queries off the padding.

Everything a decode step needs besides the new tokens is made once and reused: the buffers (written in
place, never concatenated), the attention mask (shared by all layers of a step) and the rotary cos/sin
tables of all ``max_length`` columns (sliced per step; rotary angles are elementwise in the position, so
the slice equals tables computed for the step's positions alone). With a sliding window (``--window-size``)
the mask also keeps each query off the keys more than ``window - 1`` columns before it, cached ones included
(``model/attention_mask.py``); the buffers still hold every column.

Multi-latent attention layers (``--multi-latent-attention``) store instead one ``[b, max_length,
kv_lora_rank + qk_pos_emb_head_dim]`` buffer: the normalized kv latent and the rotated key slice every head
shares (``update_latent``), which their absorbed decode attends over (``model/multi_latent_attention.py``);
``cache_latent=False`` makes them cache full keys and values like other layers.
"""

from __future__ import annotations

import torch

from megatron_like.model.attention_mask import causal_mask
from megatron_like.model.rotary import RopeScaling, rotary_cos_sin


def all_column_tables(built: dict, max_length: int, rotary_dim: int, base: float, device: torch.device,
                      scaling: RopeScaling | None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[max_length, rotary_dim]`` of positions ``0 .. max_length - 1``, built once per ``built`` dict (a
    cache's tables, keyed by the rotary settings: layers of one model may differ, e.g. multi-latent attention's)."""
    key = (rotary_dim, base, scaling)
    if key not in built:
        built[key] = rotary_cos_sin(torch.arange(max_length, device=device), rotary_dim, base, scaling)
    return built[key]


class KVCache:
    """Per-layer key/value buffers plus the padding mask of a batch being generated.

    Args:
        batch_size: rows (prompts x beams x return sequences).
        max_length: longest sequence the cache holds (prompt + new tokens).
        valid: bool ``[b, max_length]``, False at left-padding columns; None = no padding.
    """

    def __init__(self, batch_size: int, max_length: int, valid: torch.Tensor | None = None,
                 cache_latent: bool = True) -> None:
        self.batch_size, self.max_length = batch_size, max_length
        self.valid = valid
        self.cache_latent = cache_latent
        """Multi-latent attention layers cache their compressed latent (``update_latent``); False: full keys
        and values like every other layer (the reference the latent path is tested against)."""
        self.latents: dict[int, torch.Tensor] = {}
        self.offset = 0
        """Columns already filled; the next forward writes its tokens from here."""
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self._mask: tuple[tuple[int, int, int | None], torch.Tensor | None] | None = None
        self._rotary: dict[tuple[int, float, RopeScaling | None], tuple[torch.Tensor, torch.Tensor]] = {}

    def update_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, window: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Store this step's ``k, v [b, np, s, hd]`` for ``layer``; return all keys, values ``[b, np, t, hd]``
        (``t = offset + s``) and the bool attention mask ``[b, 1, s, t]`` (None: attend to everything).
        ``window``: keys per query of sliding-window attention (itself included); None: no window."""
        b, heads, s, head_dim = k.shape
        if self.offset + s > self.max_length:
            raise ValueError(f"KV cache of {self.max_length} positions cannot take {self.offset + s}")
        if layer not in self.keys:
            shape = (b, heads, self.max_length, head_dim)
            self.keys[layer] = torch.empty(shape, dtype=k.dtype, device=k.device)
            # Multi-latent attention's values are narrower than its keys.
            self.values[layer] = torch.empty(shape[:3] + v.shape[3:], dtype=v.dtype, device=v.device)
        end = self.offset + s
        self.keys[layer][:, :, self.offset:end] = k
        self.values[layer][:, :, self.offset:end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end], self.attention_mask(s, k.device, window)

    def update_latent(self, layer: int, entries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Store this step's multi-latent attention entries ``[b, s, kv_lora_rank + rope]`` (the normalized kv
        latent and the rotated shared key slice) for ``layer``; return every cached entry ``[b, t, ...]`` and the
        attention mask ``[b, 1, s, t]`` (None: attend to everything), as ``update_kv``."""
        b, s, width = entries.shape
        if self.offset + s > self.max_length:
            raise ValueError(f"KV cache of {self.max_length} positions cannot take {self.offset + s}")
        if layer not in self.latents:
            self.latents[layer] = torch.empty(b, self.max_length, width, dtype=entries.dtype, device=entries.device)
        end = self.offset + s
        self.latents[layer][:, self.offset:end] = entries
        return self.latents[layer][:, :end], self.attention_mask(s, entries.device)

    def bytes_per_token(self) -> int:
        """Cache bytes one token takes over all layers of this rank (keys, values and latents)."""
        buffers = [*self.keys.values(), *self.values.values(), *self.latents.values()]
        return sum(t.element_size() * t.numel() for t in buffers) // max(1, self.batch_size * self.max_length)

    def rotary_tables(self, s: int, rotary_dim: int, base: float, device: torch.device,
                      scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[s, rotary_dim]`` of columns ``[offset, offset + s)`` (views of tables built on first use)."""
        cos, sin = all_column_tables(self._rotary, self.max_length, rotary_dim, base, device, scaling)
        return cos[self.offset:self.offset + s], sin[self.offset:self.offset + s]

    def attention_mask(self, s: int, device: torch.device, window: int | None = None) -> torch.Tensor | None:
        """The mask of queries ``[offset, offset + s)`` over keys ``[0, offset + s)``, shared by all layers."""
        if self._mask is not None and self._mask[0] == (self.offset, s, window):
            return self._mask[1]
        end = self.offset + s
        mask = None
        if s > 1 or (window is not None and end > window):  # one query sees every key unless a window cuts it
            mask = causal_mask(self.offset, s, end, window, device)[None, None]  # (1, 1, s, t)
        if self.valid is not None and not bool(self.valid[:, :end].all()):
            keys_ok = self.valid[:, None, None, :end].to(device)  # (b, 1, 1, t)
            mask = keys_ok if mask is None else mask & keys_ok
            # A query on a padding column would see no key at all (softmax of nothing = NaN, which the
            # zero attention weights of later queries would still multiply): let it see itself.
            diagonal = torch.zeros(s, end, dtype=torch.bool, device=device)
            diagonal[torch.arange(s), torch.arange(self.offset, end)] = True
            mask = mask | diagonal[None, None]
        self._mask = ((self.offset, s, window), mask)
        return mask

    def advance(self, s: int) -> None:
        """Mark ``s`` more columns as filled (call once per model forward, after every chunk ran)."""
        self.offset += s

    def reorder(self, rows: torch.Tensor) -> None:
        """Keep rows ``rows [b]`` of every buffer in that order (beam search picks its surviving beams)."""
        for layer in self.keys:
            self.keys[layer] = self.keys[layer].index_select(0, rows)
            self.values[layer] = self.values[layer].index_select(0, rows)
        for layer in self.latents:
            self.latents[layer] = self.latents[layer].index_select(0, rows)
        if self.valid is not None:
            self.valid = self.valid.index_select(0, rows)
        self._mask = None
