"""Weighted blending of datasets (``--data-path 0.3 pathA 0.7 pathB``) with Megatron's greedy interleave.

Sample i of the blend is sample ``dataset_sample_index[i]`` of dataset ``dataset_index[i]``, where
dataset ``argmax_d(w_d * max(i, 1) - count_d)`` is chosen at each step (``index_helpers``). The two
arrays are cached like the GPT indices, named by the md5 of their description.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from megatron_like.data import index_helpers


def parse_data_path(data_path: Sequence[str]) -> tuple[list[str], list[float] | None]:
    """Return (prefixes, normalized weights or None) of ``--data-path``.

    Accepts ``['prefix']``, ``['0.3', 'a', '0.7', 'b']`` or one string ``'0.3 a 0.7 b'``.
    """
    items = list(data_path)
    if len(items) == 1 and len(items[0].split()) > 1:
        items = items[0].split()
    if not items:
        raise ValueError("--data-path is empty")
    if len(items) == 1:
        return [items[0]], None
    if len(items) % 2:
        raise ValueError(f"--data-path {' '.join(items)}: blending needs pairs of 'weight prefix'")
    prefixes, weights = [], []
    for w, p in zip(items[0::2], items[1::2]):
        try:
            weight = float(w)
        except ValueError:
            raise ValueError(
                f"--data-path {' '.join(items)}: {w!r} is not a weight; use 'w1 prefix1 w2 prefix2 ...'"
            ) from None
        if weight < 0 or not math.isfinite(weight):
            raise ValueError(f"--data-path weight {w} must be a finite number >= 0")
        weights.append(weight)
        prefixes.append(p)
    total = sum(weights)
    if total <= 0:
        raise ValueError(f"--data-path {' '.join(items)}: the weights sum to 0")
    return prefixes, [w / total for w in weights]


def blend_num_samples(weights: Sequence[float], num_samples: int) -> list[int]:
    """Return each dataset's sample count: ``ceil(w * n * 1.005)``, slack so the greedy never runs dry."""
    return [int(math.ceil(w * num_samples * 1.005)) for w in weights]


@dataclass(frozen=True)
class BlendSpec:
    """What a blend's indices depend on; its description's md5 names the cache files."""

    name: str
    prefixes: tuple[str, ...]
    weights: tuple[float, ...]
    size: int
    dataset_descriptions: tuple[str, ...]
    cache_dir: str

    def description(self) -> str:
        """Return the text whose md5 names the cache files."""
        lines = ["Blended Dataset", "", f"Name {self.name}", f"Size {self.size}"]
        lines += [f"Weight {w!r} prefix {p}" for w, p in zip(self.weights, self.prefixes)]
        lines += ["", *self.dataset_descriptions]
        return "\n".join(lines) + "\n"

    def paths(self) -> dict[str, str]:
        """Return the cache files: 'desc', 'index' (dataset of each sample), 'sample' (sample in it)."""
        digest = hashlib.md5(self.description().encode("utf-8"), usedforsecurity=False).hexdigest()
        base = os.path.join(self.cache_dir, digest)
        return {
            "desc": base + ".dsc",
            "index": base + "_dataset_index.npy",
            "sample": base + "_dataset_sample_index.npy",
        }

    def is_cached(self) -> bool:
        """Return whether all cache files exist."""
        return all(os.path.isfile(p) for p in self.paths().values())

    def build_and_save(self) -> None:
        """Compute the greedy interleave and write it (description last, as a completion mark)."""
        dataset_index, sample_index = index_helpers.build_blending_indices(np.array(self.weights), self.size)
        os.makedirs(self.cache_dir, exist_ok=True)
        paths = self.paths()
        for key, array in (("index", dataset_index), ("sample", sample_index)):
            tmp = f"{paths[key]}.tmp-{os.getpid()}.npy"
            np.save(tmp, array, allow_pickle=False)
            os.replace(tmp, paths[key])
        tmp = f"{paths['desc']}.tmp-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(self.description())
        os.replace(tmp, paths["desc"])


class BlendedDataset(torch.utils.data.Dataset):
    """``size`` samples drawn from several datasets in the proportions of their weights."""

    def __init__(self, datasets: Sequence, spec: BlendSpec) -> None:
        self.datasets = list(datasets)
        self.spec = spec
        paths = spec.paths()
        if not spec.is_cached():
            raise FileNotFoundError(
                f"blending index cache incomplete ({paths['desc']}): the index-builder rank did not write it"
            )
        self.dataset_index = np.load(paths["index"], mmap_mode="r", allow_pickle=False)
        """int16 [size]: which dataset serves each sample."""
        self.dataset_sample_index = np.load(paths["sample"], mmap_mode="r", allow_pickle=False)
        """int64 [size]: the sample within that dataset."""
        counts = np.bincount(np.asarray(self.dataset_index), minlength=len(self.datasets))
        for d, (count, ds) in enumerate(zip(counts, self.datasets)):
            if count and (ds is None or count > len(ds)):
                have = 0 if ds is None else len(ds)
                raise ValueError(
                    f"blend {spec.name}: dataset {spec.prefixes[d]} must serve {count} samples, has {have}"
                )

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        """Return the sample dict of blended sample ``idx`` ({"text": int64 [seq_length + 1]})."""
        dataset = int(self.dataset_index[idx])
        return self.datasets[dataset][int(self.dataset_sample_index[idx])]
