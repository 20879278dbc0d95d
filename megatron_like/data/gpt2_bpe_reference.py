"""A pure-Python GPT-2 byte-level BPE, written from the published algorithm (OpenAI's ``encoder.py``).

It is plain Python, no Rust and no C. Tests use it as the independent reference that the
fast ``GPT2BPETokenizer`` must equal, and ``benchmarks/preprocess.py`` uses it as the pure-Python peer
(``--tokenizer-type PurePythonGPT2BPETokenizer`` in ``data_tools/preprocess.py``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import lru_cache

import regex

from megatron_like.data.tokenizer import GPT2_EOD_TOKEN, Tokenizer, default_gpt2_files

# GPT-2's pre-tokenization: contractions, letter runs, number runs, other-symbol runs, whitespace.
GPT2_PATTERN = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """Return GPT-2's map of the 256 byte values to printable unicode characters."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    mapping = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shift)
            shift += 1
    return mapping


class PurePythonGPT2BPETokenizer(Tokenizer):
    """GPT-2 BPE in plain Python: regex split, bytes -> unicode symbols, greedy lowest-rank merges."""

    def __init__(self, vocab_file: str | None = None, merge_file: str | None = None) -> None:
        if vocab_file is None or merge_file is None:
            vocab_file, merge_file = default_gpt2_files()
        with open(vocab_file, encoding="utf-8") as f:
            self.encoder: dict[str, int] = json.load(f)
        self.decoder = {i: s for s, i in self.encoder.items()}
        with open(merge_file, encoding="utf-8") as f:
            lines = [ln for ln in f.read().split("\n") if ln and not ln.startswith("#version")]
        self.ranks = {tuple(ln.split()): r for r, ln in enumerate(lines)}
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}
        self.cache: dict[str, list[str]] = {}
        self.vocab_size = len(self.encoder)
        self.eod = self.encoder[GPT2_EOD_TOKEN]

    def _bpe(self, word: str) -> list[str]:
        """Return the BPE symbols of one pre-token (already mapped to byte-unicode characters)."""
        cached = self.cache.get(word)
        if cached is not None:
            return cached
        parts = list(word)
        while len(parts) > 1:
            best_rank, best_at = None, -1
            for i in range(len(parts) - 1):
                rank = self.ranks.get((parts[i], parts[i + 1]))
                if rank is not None and (best_rank is None or rank < best_rank):
                    best_rank, best_at = rank, i
            if best_rank is None:
                break
            first, second = parts[best_at], parts[best_at + 1]
            merged: list[str] = []
            i = 0
            while i < len(parts):
                if i < len(parts) - 1 and parts[i] == first and parts[i + 1] == second:
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        self.cache[word] = parts
        return parts

    def tokenize(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in GPT2_PATTERN.findall(text):
            word = "".join(self.byte_encoder[b] for b in piece.encode("utf-8"))
            ids.extend(self.encoder[s] for s in self._bpe(word))
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        text = "".join(self.decoder[int(i)] for i in ids)
        return bytes(self.byte_decoder[c] for c in text).decode("utf-8", errors="replace")
