"""Megatron's GPT dataset: fixed-length samples cut from a shuffled stream of documents.

A split is a contiguous range of documents (``--split 969,30,1``). Its indices (``doc_idx``,
``sample_idx``, ``shuffle_idx``, see ``index_helpers.py``) come from one ``np.random.RandomState(seed)``
and are cached as ``.npy`` files named by the md5 of a description of everything they depend on, so a
later run (or another rank) loads instead of rebuilding. ``ds[i]`` is ``{"text": int64 [seq_length + 1]}``:
tokens ``[:-1]`` are the inputs, ``[1:]`` the labels.

``build_train_valid_test_datasets`` (in ``dataset_builder.py``) is re-exported here.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import numpy as np
import torch

from megatron_like.data import index_helpers
from megatron_like.data.indexed_dataset import IndexedDataset

SPLIT_NAMES = ("train", "valid", "test")


def parse_split(split: str) -> list[float]:
    """Return the three normalized split weights of ``--split`` ('969,30,1', '98/2/0' or '100')."""
    parts = split.replace("/", ",").split(",")
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"--split {split!r} must be comma-separated numbers like 969,30,1") from None
    if len(weights) > 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"--split {split!r} needs up to three non-negative numbers with a positive sum")
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    return [w / total for w in weights]


def get_split_ranges(split: str, num_documents: int) -> list[int]:
    """Return the 4 document boundaries [0, a, b, num_documents] of train/valid/test (Megatron's rounding)."""
    bounds = [0]
    for w in parse_split(split):
        bounds.append(bounds[-1] + int(round(w * float(num_documents))))
    diff = bounds[-1] - num_documents
    return [bounds[0]] + [b - diff for b in bounds[1:]]


@dataclass(frozen=True)
class GPTDatasetSpec:
    """Everything a split's indices depend on; its description's md5 names the cache files."""

    name: str
    """'train', 'valid' or 'test'."""
    prefix: str
    """Dataset prefix (``<prefix>.bin``/``.idx``)."""
    doc_start: int
    """First document of the split."""
    doc_stop: int
    """One past the last document of the split."""
    num_samples: int
    """Samples requested; the indices hold at least this many."""
    seq_length: int
    seed: int
    split: str
    data_num_documents: int
    """Documents in the whole dataset (a rebuilt dataset gets new indices)."""
    data_num_tokens: int
    cache_dir: str

    def description(self) -> str:
        """Return the text whose md5 names the cache files (also saved beside them as ``.dsc``)."""
        return (
            "GPT Dataset\n\n"
            f"Data prefix {self.prefix}\n"
            f"Dataset name {self.name}\n"
            f"Number of samples {self.num_samples}\n"
            f"Sequence length {self.seq_length}\n"
            f"Random seed {self.seed}\n"
            f"Split {self.split}\n"
            f"Documents [{self.doc_start}, {self.doc_stop})\n"
            f"Data documents {self.data_num_documents} tokens {self.data_num_tokens}\n"
        )

    def paths(self) -> dict[str, str]:
        """Return the cache file of each index ('doc', 'sample', 'shuffle') and of the description."""
        digest = hashlib.md5(self.description().encode("utf-8"), usedforsecurity=False).hexdigest()
        base = os.path.join(self.cache_dir, digest)
        return {
            "desc": base + ".dsc",
            "doc": base + "_doc_idx.npy",
            "sample": base + "_sample_idx.npy",
            "shuffle": base + "_shuffle_idx.npy",
        }

    def is_cached(self) -> bool:
        """Return whether all cache files exist."""
        return all(os.path.isfile(p) for p in self.paths().values())


def build_gpt_indices(spec: GPTDatasetSpec, document_sizes: np.ndarray) -> dict[str, np.ndarray]:
    """Return the 'doc', 'sample' and 'shuffle' indices of a split (Megatron's recipe).

    ``document_sizes`` is int64/int32 [D]: tokens of every document of the dataset.
    """
    documents = np.arange(spec.doc_start, spec.doc_stop, dtype=np.int32)
    sizes = np.asarray(document_sizes, dtype=np.int32)
    tokens_per_epoch = int(sizes[documents].sum(dtype=np.int64))
    if tokens_per_epoch == 0:
        raise ValueError(
            f"the {spec.name} split of {spec.prefix} (documents {spec.doc_start}..{spec.doc_stop - 1}) "
            "holds only empty documents"
        )
    num_epochs = index_helpers.num_epochs_needed(tokens_per_epoch, spec.seq_length, spec.num_samples)
    rng = np.random.RandomState(seed=spec.seed)
    separate_last_epoch = False
    if num_epochs > 1:
        # When the last epoch supplies few samples, shuffle it apart so its documents are not over-drawn.
        from_full_epochs = ((num_epochs - 1) * tokens_per_epoch - 1) // spec.seq_length
        last_epoch_samples = spec.num_samples - from_full_epochs
        per_epoch = (tokens_per_epoch - 1) // spec.seq_length
        separate_last_epoch = last_epoch_samples < int(0.80 * per_epoch)
    doc_idx = index_helpers.build_doc_idx(documents, num_epochs, rng, separate_last_epoch)
    sample_idx = index_helpers.build_sample_idx(sizes, doc_idx, spec.seq_length, num_epochs, tokens_per_epoch)
    total = sample_idx.shape[0] - 1
    first = from_full_epochs if separate_last_epoch else total
    shuffle_idx = index_helpers.build_shuffle_idx(first, total, rng)
    return {"doc": doc_idx, "sample": sample_idx, "shuffle": shuffle_idx}


def _save_atomic(path: str, array: np.ndarray) -> None:
    tmp = f"{path}.tmp-{os.getpid()}.npy"
    np.save(tmp, array, allow_pickle=False)
    os.replace(tmp, path)


def save_gpt_indices(spec: GPTDatasetSpec, indices: dict[str, np.ndarray]) -> None:
    """Write the indices and then the description (the description last marks a complete set)."""
    try:
        os.makedirs(spec.cache_dir, exist_ok=True)
    except OSError as exc:
        raise OSError(f"cannot create the index cache {spec.cache_dir}: {exc}; set --data-cache-path") from exc
    paths = spec.paths()
    for key in ("doc", "sample", "shuffle"):
        _save_atomic(paths[key], indices[key])
    tmp = f"{paths['desc']}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(spec.description())
    os.replace(tmp, paths["desc"])


class GPTDataset(torch.utils.data.Dataset):
    """Samples of ``seq_length + 1`` tokens from one split; indices loaded (mmap) from the cache."""

    def __init__(self, spec: GPTDatasetSpec, indexed_dataset: IndexedDataset) -> None:
        self.spec = spec
        self.name = spec.name
        self.indexed_dataset = indexed_dataset
        self.seq_length = spec.seq_length
        paths = spec.paths()
        missing = [p for p in paths.values() if not os.path.isfile(p)]
        if missing:
            raise FileNotFoundError(
                f"dataset index cache incomplete, missing {missing[0]}: the index-builder rank did not "
                "write it (is --data-cache-path shared by all ranks?)"
            )
        self.doc_idx = np.load(paths["doc"], mmap_mode="r", allow_pickle=False)
        """int32 [epochs * docs]: document ids in stream order."""
        self.sample_idx = np.load(paths["sample"], mmap_mode="r", allow_pickle=False)
        """int32/int64 [num_samples + 1, 2]: (doc_idx position, offset) where each sample starts."""
        self.shuffle_idx = np.load(paths["shuffle"], mmap_mode="r", allow_pickle=False)
        """uint32/int64 [num_samples]: serving order."""

    def __len__(self) -> int:
        """Return the samples available (at least the requested number)."""
        return self.sample_idx.shape[0] - 1

    def _tokens(self, position: int, offset: int, stop: int | None) -> np.ndarray:
        doc = self.indexed_dataset.get_document(int(self.doc_idx[position]))
        return doc[offset:stop]

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        """Return {"text": int64 [seq_length + 1]} for sample ``idx`` (after shuffling)."""
        if not -len(self) <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for the {self.name} dataset of {len(self)} samples")
        i = int(self.shuffle_idx[idx])
        first_pos, first_off = (int(v) for v in self.sample_idx[i])
        last_pos, last_off = (int(v) for v in self.sample_idx[i + 1])
        if first_pos == last_pos:
            text = self._tokens(first_pos, first_off, last_off + 1)
        else:
            parts = [self._tokens(first_pos, first_off, None)]
            parts += [self._tokens(p, 0, None) for p in range(first_pos + 1, last_pos)]
            parts.append(self._tokens(last_pos, 0, last_off + 1))
            text = np.concatenate(parts)
        return {"text": np.asarray(text, dtype=np.int64)}


def __getattr__(name: str):
    # Lazy re-export: dataset_builder imports this module, so importing it at the top would be a cycle.
    if name == "build_train_valid_test_datasets":
        from megatron_like.data.dataset_builder import build_train_valid_test_datasets

        return build_train_valid_test_datasets
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
