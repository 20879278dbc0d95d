"""The key/value cache of continuous batching: a fixed number of slots, each one sequence of its own length.

``KVCache`` (kv_cache.py) serves one ``generate`` call: its rows are left padded to a common column and advance
together. A server batches requests that arrive at different times, with prompts of different lengths, and that
end at different steps, so here every slot keeps its own length: a forward runs on any subset of the slots
(``begin(slots, s)``), each row's ``s`` new tokens are written at that row's next columns, at its own positions,
and attend to that row's cached keys only. A slot is reused by the next request once its sequence ended
(``release``); nothing is moved or re-padded when requests join or leave.

Per layer the buffers are ``[slots, ng, max_length, hd]`` (``[slots, max_length, width]`` for multi-latent
attention's latents), allocated on first use as in ``KVCache``. A forward over rows ``r`` with lengths ``l_r``
reads columns ``[0, max_r l_r + s)`` of those rows; the mask ``[n, 1, s, t]`` keeps row ``r``'s query ``i``
(position ``l_r + i``) on columns ``<= l_r + i`` (and, with a sliding window, ``> l_r + i - window``), so the
stale columns of a shorter row, or of the slot's previous request, are never attended to. Rotary tables are
indexed per row with its positions (``[n, 1, s, rotary_dim]``, which the rotary op broadcasts over heads).

    cache = SlotKVCache(slots=16, max_length=2048)
    positions = cache.begin([3], len(prompt))          # prefill slot 3: positions [1, s]
    logits = runner(prompt_ids, positions, cache)      # ModelRunner; cache.advance(s) grows slot 3's length
    positions = cache.begin([3, 5], 1)                 # one decode step of slots 3 and 5
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
        self._index: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows [n, s], columns [n, s]) written
        self._mask: dict[int | None, torch.Tensor | None] = {}
        self._rotary: dict[tuple[int, float, RopeScaling | None], tuple[torch.Tensor, torch.Tensor]] = {}

    # ------------------------------------------------------------------ one forward
    def begin(self, rows: Sequence[int], s: int) -> torch.Tensor:
        """Prepare a forward of ``s`` new tokens in each slot of ``rows``; return their positions ``[n, s]``."""
        rows = list(rows)
        if not rows or len(set(rows)) != len(rows) or not all(0 <= r < self.slots for r in rows):
            raise ValueError(f"rows {rows} must be distinct slots in [0, {self.slots})")
        over = [r for r in rows if self.lengths[r] + s > self.max_length]
        if over:
            raise ValueError(f"slot {over[0]} holds {self.lengths[over[0]]} tokens: {s} more exceed the cache's "
                             f"{self.max_length} positions")
        self._rows, self._step_length = rows, s
        starts = torch.tensor([self.lengths[r] for r in rows], dtype=torch.long, device=self.device)
        positions = starts[:, None] + torch.arange(s, device=self.device)[None]  # (n, s)
        row_index = torch.tensor(rows, dtype=torch.long, device=self.device)[:, None].expand(-1, s)
        self._index = (row_index, positions)
        # Consecutive slots (the usual case: free slots are taken lowest first) are read as a view, not gathered.
        self._span = slice(rows[0], rows[0] + len(rows)) if rows == list(range(rows[0], rows[0] + len(rows))) else None
        self._mask = {}
        self.positions = positions
        return positions

    @property
    def _columns(self) -> int:
        """Columns a step reads: up to the longest row's new end."""
        return max(self.lengths[r] for r in self._rows) + self._step_length

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
        """cos, sin ``[n, 1, s, rotary_dim]`` at each row's positions (tables of all columns built on first use)."""
        cos, sin = all_column_tables(self._rotary, self.max_length, rotary_dim, base, device, scaling)
        return cos[self.positions][:, None], sin[self.positions][:, None]

    def advance(self, s: int) -> None:
        """The step's rows now hold ``s`` more tokens (``ModelRunner`` calls it after every chunk ran)."""
        for r in self._rows:
            self.lengths[r] += s

    # ------------------------------------------------------------------ slots
    def copy_slot(self, source: int, target: int) -> None:
        """Make slot ``target`` a copy of ``source`` (the ``n`` choices of one prompt share its prefill)."""
        for buffers in (self.keys, self.values, self.latents):
            for buffer in buffers.values():
                buffer[target] = buffer[source]
        self.lengths[target] = self.lengths[source]

    def release(self, slot: int) -> None:
        """Free ``slot`` for the next request (its stale columns stay, masked out by the new lengths)."""
        self.lengths[slot] = 0
