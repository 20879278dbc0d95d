"""The key/value cache of continuous batching: a fixed number of slots, each one sequence of its own length.

``KVCache`` (kv_cache.py) serves one ``generate`` call: its rows are left padded to a common column and advance
together. A server batches requests that arrive at different times, with prompts of different lengths, and that
end at different steps, so here every slot keeps its own length: a forward runs on any subset of the slots
(``begin(slots, s)``), each row's new tokens are written at that row's next columns, at its own positions,
and attend to that row's cached keys only. A slot is reused by the next request once its sequence ended
(``release``); nothing is moved or re-padded when requests join or leave.

Per layer the buffers are ``[slots, ng, max_length, hd]`` (``[slots, max_length, width]`` for multi-latent
attention's latents), allocated on first use as in ``KVCache``. A forward over rows ``r`` with lengths ``l_r``
reads columns ``[0, max_r l_r + s)`` of those rows; the mask ``[n, 1, s, t]`` keeps row ``r``'s query ``i``
(position ``l_r + i``) on columns ``<= l_r + i`` (and, with a sliding window, ``> l_r + i - window``), so the
stale columns of a shorter row, or of the slot's previous request, are never attended to. Rotary tables are
gathered once per forward at the rows' positions (``[n, 1, s, rotary_dim]``, which the rotary op broadcasts over
heads) and shared by every layer. All of a forward's bookkeeping is a handful of tensor operations over all rows
(one scatter per buffer, one mask, one rotary gather), whatever the number of rows.

Prompts of different lengths are prefilled in one forward (``begin(slots, s, counts)``: row ``r`` brings
``counts[r] <= s`` real tokens, *left* padded to ``s``, so that every row's last real token is the forward's last
column and the model's next-token logits are those of every row). The padding columns are not attention
padding here: each is written like a token, at a column *after* the row's real ones (column ``j`` of the forward
holds position ``l_r + (j + counts[r]) mod s``: the real tokens get ``l_r .. l_r + counts[r] - 1`` in order, the
``s - counts[r]`` pads the next ones). A real query's causal mask ends at its own position, before every pad; the
row's length grows by ``counts[r]`` only, so its next tokens overwrite the pads' columns before any query can see
them. A pad's own query sees the real tokens and the pads before it (never an empty row: no NaN); its output is
dropped.

    cache = SlotKVCache(slots=16, max_length=2048)
    positions = cache.begin([3], len(prompt))          # prefill slot 3: positions [1, s]
    logits = runner(prompt_ids, positions, cache)      # ModelRunner; cache.advance(s) grows slot 3's length
    positions = cache.begin([3, 5], 1)                 # one decode step of slots 3 and 5
    positions = cache.begin([6, 7], 9, counts=[4, 9])  # prefill two prompts, of 4 and 9 tokens, in one forward
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_like.inference.kv_cache import all_column_tables
from megatron_like.model.rotary import RopeScaling


class SlotKVCache:
    """Per-layer key/value buffers of ``slots`` independent sequences (continuous batching).

    Args:
        slots: sequences held at once (the server's ``--max-batch-size``).
        max_length: longest sequence one slot holds (prompt + generated tokens).
        device: where the step tensors (positions, masks) live; the model's device.
        cache_latent: multi-latent attention layers cache their compressed latent (as ``KVCache``).
    """

    def __init__(self, slots: int, max_length: int, device: torch.device, cache_latent: bool = True) -> None:
        self.slots, self.max_length, self.device = slots, max_length, device
        self.cache_latent = cache_latent
        self.lengths = [0] * slots
        """Tokens cached per slot; the next token of slot ``i`` goes to column ``lengths[i]``."""
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.latents: dict[int, torch.Tensor] = {}
        self._rows: list[int] = []
        self._step_length = 0
        self._counts: list[int] = []
        self._columns = 0
        self._index: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows [n, s], columns [n, s]) written
        self._mask: dict[int | None, torch.Tensor | None] = {}
        self._rotary: dict[tuple[int, float, RopeScaling | None], tuple[torch.Tensor, torch.Tensor]] = {}
        self._step_rotary: dict[tuple[int, float, RopeScaling | None], tuple[torch.Tensor, torch.Tensor]] = {}

    # ------------------------------------------------------------------ one forward
    def begin(self, rows: Sequence[int], s: int, counts: Sequence[int] | None = None) -> torch.Tensor:
        """Prepare a forward of ``s`` new tokens in each slot of ``rows`` (of which ``counts[i]`` are real, left
        padded to ``s``; None: all ``s``); return their positions ``[n, s]`` (see the module docstring)."""
        rows = list(rows)
        counts = [s] * len(rows) if counts is None else list(counts)
        if not rows or len(set(rows)) != len(rows) or not all(0 <= r < self.slots for r in rows):
            raise ValueError(f"rows {rows} must be distinct slots in [0, {self.slots})")
        if len(counts) != len(rows) or not all(1 <= c <= s for c in counts):
            raise ValueError(f"counts {counts} must give each of the {len(rows)} rows 1 to {s} tokens")
        over = [r for r in rows if self.lengths[r] + s > self.max_length]
        if over:
            raise ValueError(f"slot {over[0]} holds {self.lengths[over[0]]} tokens: {s} more exceed the cache's "
                             f"{self.max_length} positions")
        self._rows, self._counts, self._step_length = rows, counts, s
        self._columns = max(self.lengths[r] for r in rows) + s  # columns this forward reads: to the longest row's end
        starts = torch.tensor([self.lengths[r] for r in rows], dtype=torch.long, device=self.device)
        offsets = torch.arange(s, device=self.device)[None]  # (1, s)
        if any(c != s for c in counts):  # left padded: real tokens first in the cache, the pads after them
            offsets = (offsets + torch.tensor(counts, device=self.device)[:, None]) % s
        positions = starts[:, None] + offsets  # (n, s)
        row_index = torch.tensor(rows, dtype=torch.long, device=self.device)[:, None].expand(-1, s)
        self._index = (row_index, positions)  # where each token is written: (slot, column), both [n, s]
        # Consecutive slots (BatchEngine keeps its running ones so) are read as a view, not gathered.
        self._span = slice(rows[0], rows[0] + len(rows)) if rows == list(range(rows[0], rows[0] + len(rows))) else None
        self._mask = {}
        self._step_rotary = {}
        self.positions = positions
        return positions

    def attention_mask(self, window: int | None = None) -> torch.Tensor | None:
        """bool ``[n, 1, s, t]``: each row's queries see that row's columns up to themselves (and within the window);
        None when that is every column (one query per row, rows of one length, no window cutting in)."""
        if window not in self._mask:
            lengths = {self.lengths[r] for r in self._rows}
            t = self._columns
            if self._step_length == 1 and len(lengths) == 1 and (window is None or window >= t):
                self._mask[window] = None  # SDPA without a mask: its fastest path
            else:
                keys = torch.arange(t, device=self.device)[None, None, :]  # (1, 1, t)
                queries = self.positions[:, :, None]  # (n, s, 1)
                mask = keys <= queries
                if window is not None:
                    mask = mask & (keys > queries - window)
                self._mask[window] = mask[:, None]
        return self._mask[window]

    def update_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, window: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Store ``k, v [n, ng, s, hd]`` of this step's rows for ``layer``; return their keys, values ``[n, ng, t, hd]``
        and the mask ``[n, 1, s, t]`` or None (as ``KVCache.update_kv``)."""
        if layer not in self.keys:
            _, heads, _, head_dim = k.shape
            self.keys[layer] = torch.zeros(self.slots, heads, self.max_length, head_dim, dtype=k.dtype, device=k.device)
            self.values[layer] = torch.zeros(self.slots, heads, self.max_length, v.shape[3], dtype=v.dtype,
                                             device=v.device)
        rows, columns = self._index
        # Two index tensors split by a slice put their dimensions first: the target is [n, s, ng, hd].
        self.keys[layer][rows, :, columns] = k.permute(0, 2, 1, 3)
        self.values[layer][rows, :, columns] = v.permute(0, 2, 1, 3)
        return self._read(self.keys[layer]), self._read(self.values[layer]), self.attention_mask(window)

    def _read(self, buffer: torch.Tensor) -> torch.Tensor:
        """This step's rows of ``buffer [slots, ng, max_length, hd]``, columns ``[0, t)``: ``[n, ng, t, hd]``."""
        columns = buffer[:, :, : self._columns]
        if self._span is not None:
            return columns[self._span]
        return columns.index_select(0, self._index[0][:, 0])

    def update_latent(self, layer: int, entries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Store multi-latent attention entries ``[n, s, width]``; return the rows' entries ``[n, t, width]`` and the
        mask ``[n, 1, s, t]`` (as ``KVCache.update_latent``)."""
        if layer not in self.latents:
            self.latents[layer] = torch.zeros(self.slots, self.max_length, entries.shape[2], dtype=entries.dtype,
                                              device=entries.device)
        rows, columns = self._index
        self.latents[layer][rows, columns] = entries
        entries = self.latents[layer][:, : self._columns]
        entries = entries[self._span] if self._span is not None else entries.index_select(0, rows[:, 0])
        return entries, self.attention_mask()

    def rotary_tables(self, s: int, rotary_dim: int, base: float, device: torch.device,
                      scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[n, 1, s, rotary_dim]`` at each row's positions: gathered once per forward from tables of all
        columns (built on first use), then shared by every layer."""
        key = (rotary_dim, base, scaling)
        if key not in self._step_rotary:
            cos, sin = all_column_tables(self._rotary, self.max_length, rotary_dim, base, device, scaling)
            self._step_rotary[key] = cos[self.positions][:, None], sin[self.positions][:, None]
        return self._step_rotary[key]

    def advance(self, s: int) -> None:
        """The step's rows now hold their real new tokens (``ModelRunner`` calls it after every chunk ran; ``s``, the
        forward's width, is also each row's count unless ``begin`` was given counts)."""
        for r, count in zip(self._rows, self._counts):
            self.lengths[r] += count

    # ------------------------------------------------------------------ slots
    def copy_slot(self, source: int, target: int) -> None:
        """Make slot ``target`` a copy of ``source``'s cached tokens (the ``n`` choices of one prompt share its
        prefill; a sequence moves to a lower slot)."""
        filled = self.lengths[source]
        for buffers in (self.keys, self.values):
            for buffer in buffers.values():
                buffer[target, :, :filled] = buffer[source, :, :filled]
        for buffer in self.latents.values():
            buffer[target, :filled] = buffer[source, :filled]
        self.lengths[target] = filled

    def release(self, slot: int) -> None:
        """Free ``slot`` for the next request (its stale columns stay, masked out by the new lengths)."""
        self.lengths[slot] = 0
