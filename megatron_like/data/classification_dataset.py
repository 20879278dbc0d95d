"""Sentence-pair classification data (GLUE MRPC style) and epoch-wise sampling of finite datasets.

Input files hold one example per line, with ``sentence1``, ``sentence2`` and an integer ``label``:

* JSONL: ``{"sentence1": "...", "sentence2": "...", "label": 1}``;
* TSV with a header naming the columns ``sentence1``, ``sentence2``, ``label`` (any order, other
  columns ignored), or GLUE's original MRPC header ``Quality  #1 ID  #2 ID  #1 String  #2 String``.

A pair becomes ``tokens(sentence1) + [sep] + tokens(sentence2)`` (sep = the tokenizer's end-of-text id,
as GPT-2 fine-tuning does), truncated longest-first to ``seq_length`` and right-padded with ``pad_id``.
The sample records the position of its last real token, where the classifier reads the sequence:
``{"tokens": int64 [seq_length], "last_index": int64 [], "label": int64 []}``.
"""

from __future__ import annotations

import csv
import functools
import json
from collections.abc import Callable
from typing import Any

import numpy as np

MRPC_COLUMNS = {"#1 String": "sentence1", "#2 String": "sentence2", "Quality": "label"}


def read_sentence_pairs(path: str) -> list[dict[str, Any]]:
    """Examples ``{"sentence1": str, "sentence2": str, "label": int}`` of a JSONL or TSV file."""
    if path.endswith((".jsonl", ".json")):
        with open(path, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
    else:
        with open(path, encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
            rows = [{MRPC_COLUMNS.get(k, k): v for k, v in row.items()} for row in reader]
    examples = []
    for number, row in enumerate(rows, start=1):
        missing = [k for k in ("sentence1", "sentence2", "label") if row.get(k) is None]
        if missing:
            raise ValueError(f"{path}: example {number} lacks {', '.join(missing)} (columns: sentence1, sentence2, "
                             "label)")
        examples.append({"sentence1": str(row["sentence1"]), "sentence2": str(row["sentence2"]),
                         "label": int(row["label"])})
    if not examples:
        raise ValueError(f"{path} holds no examples")
    return examples


def truncate_pair(a: list[int], b: list[int], max_tokens: int) -> tuple[list[int], list[int]]:
    """Drop tokens from the end of the longer sequence until ``len(a) + len(b) <= max_tokens``."""
    a, b = list(a), list(b)
    while len(a) + len(b) > max_tokens:
        (a if len(a) >= len(b) else b).pop()
    return a, b


def encode_pair(tokens_a: list[int], tokens_b: list[int], seq_length: int, sep_id: int,
                pad_id: int) -> tuple[np.ndarray, int]:
    """``a + [sep] + b`` truncated and right-padded to ``seq_length``: (int64 ``[seq_length]``, last index)."""
    a, b = truncate_pair(tokens_a, tokens_b, seq_length - 1)
    ids = a + [sep_id] + b
    tokens = np.full(seq_length, pad_id, dtype=np.int64)
    tokens[: len(ids)] = ids
    return tokens, len(ids) - 1


class SentencePairDataset:
    """Tokenized sentence pairs of one file; ``ds[i]`` is the sample described in the module docstring."""

    def __init__(self, path: str, tokenize: Callable[[str], list[int]], seq_length: int, sep_id: int,
                 pad_id: int, num_classes: int) -> None:
        self.examples = read_sentence_pairs(path)
        self.samples = []
        for number, example in enumerate(self.examples, start=1):
            if not 0 <= example["label"] < num_classes:
                raise ValueError(f"{path}: example {number} has label {example['label']}, outside "
                                 f"[0, --num-classes {num_classes})")
            tokens, last = encode_pair(tokenize(example["sentence1"]), tokenize(example["sentence2"]), seq_length,
                                       sep_id, pad_id)
            self.samples.append({"tokens": tokens, "last_index": np.int64(last), "label": np.int64(example["label"])})

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return self.samples[index]


class EpochDataset:
    """``num_samples`` samples read epoch after epoch from a finite dataset, reshuffled every epoch.

    Sample ``i`` is ``base[perm_e[i % n]]`` with ``e = i // n`` and ``perm_e`` a permutation drawn from
    ``(seed, e)`` (the identity without ``shuffle``), so every rank computes the same order alone and a
    resumed run continues it exactly.
    """

    def __init__(self, base: Any, num_samples: int, seed: int, shuffle: bool = True) -> None:
        if len(base) == 0:
            raise ValueError("cannot sample epochs of an empty dataset")
        self.base, self.num_samples, self.seed, self.shuffle = base, num_samples, seed, shuffle

    def __len__(self) -> int:
        return self.num_samples

    @functools.lru_cache(maxsize=4)  # noqa: B019 - a handful of permutations per dataset object
    def permutation(self, epoch: int) -> np.ndarray:
        n = len(self.base)
        return np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)

    def __getitem__(self, index: int) -> Any:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range [0, {self.num_samples})")
        epoch, position = divmod(index, len(self.base))
        return self.base[int(self.permutation(epoch)[position])]
