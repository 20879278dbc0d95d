"""``build_train_valid_test_datasets``: from ``--data-path``/``--split`` to train, valid and test datasets.

Three phases keep every rank in step: (1) all ranks open the data and check the request (so a bad
split fails everywhere at once, never as a hang at the barrier); (2) the index-builder rank writes any
missing cached indices; (3) everyone passes ``barrier()`` once and loads them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from torch.utils.data import Dataset

from megatron_like.data.blended_dataset import BlendedDataset, BlendSpec, blend_num_samples, parse_data_path
from megatron_like.data.gpt_dataset import (
    SPLIT_NAMES,
    GPTDataset,
    GPTDatasetSpec,
    build_gpt_indices,
    get_split_ranges,
    parse_split,
    save_gpt_indices,
)
from megatron_like.data.indexed_dataset import IndexedDataset


def default_cache_dir(prefix: str, data_cache_path: str | None) -> str:
    """Return ``--data-cache-path`` or, without it, ``<directory of the prefix>/index-cache``."""
    if data_cache_path:
        return data_cache_path
    return os.path.join(os.path.dirname(os.path.abspath(prefix)), "index-cache")


def _split_specs(
    prefix: str,
    indexed: IndexedDataset,
    split: str,
    seq_length: int,
    seed: int,
    num_samples: Sequence[int],
    cache_dir: str,
) -> list[GPTDatasetSpec | None]:
    """Return the spec of each split, None where the split is unused (weight 0 or no samples asked)."""
    weights = parse_split(split)
    bounds = get_split_ranges(split, indexed.num_documents)
    specs: list[GPTDatasetSpec | None] = []
    for s, name in enumerate(SPLIT_NAMES):
        start, stop = bounds[s], bounds[s + 1]
        if weights[s] == 0 or num_samples[s] <= 0:
            specs.append(None)
            continue
        if stop <= start:
            raise ValueError(
                f"--split {split} leaves the {name} split of {prefix} without documents "
                f"({indexed.num_documents} documents in all); use more data or a larger {name} share"
            )
        specs.append(
            GPTDatasetSpec(
                name=name,
                prefix=prefix,
                doc_start=start,
                doc_stop=stop,
                num_samples=int(num_samples[s]),
                seq_length=seq_length,
                seed=seed,
                split=split,
                data_num_documents=indexed.num_documents,
                data_num_tokens=indexed.num_tokens,
                cache_dir=cache_dir,
            )
        )
    return specs


def build_train_valid_test_datasets(
    data_path: list[str],
    split: str,
    seq_length: int,
    seed: int,
    train_valid_test_num_samples: tuple[int, int, int],
    data_cache_path: str | None,
    is_index_builder: bool,
    barrier: Callable[[], None],
) -> tuple[Dataset | None, Dataset | None, Dataset | None]:
    """Return (train, valid, test) datasets; ``ds[i]`` is {"text": int64 [seq_length + 1]}.

    ``data_path`` is ``['prefix']`` or ``['0.3', 'prefixA', '0.7', 'prefixB']`` (blend). A split is None
    when its ``--split`` weight is 0 or no samples are requested for it; a split that is asked for
    samples but holds no document raises ``ValueError``. Every rank must call this (it calls
    ``barrier()`` exactly once); only the one with ``is_index_builder`` writes the cached indices.
    """
    if seq_length <= 0:
        raise ValueError(f"--seq-length {seq_length} must be positive")
    prefixes, weights = parse_data_path(data_path)
    num_samples = [int(n) for n in train_valid_test_num_samples]
    if len(num_samples) != 3 or any(n < 0 for n in num_samples):
        raise ValueError(f"train_valid_test_num_samples {train_valid_test_num_samples} must be 3 counts >= 0")

    # Phase 1 (all ranks): open the data and describe every index, validating the request.
    indexed = {p: IndexedDataset(p) for p in prefixes}
    per_prefix_samples = (
        [num_samples]
        if weights is None
        else [list(c) for c in zip(*[blend_num_samples(weights, n) for n in num_samples])]
    )
    specs = {
        p: _split_specs(
            p,
            indexed[p],
            split,
            seq_length,
            seed,
            per_prefix_samples[i],
            default_cache_dir(p, data_cache_path),
        )
        for i, p in enumerate(prefixes)
    }
    blends: list[BlendSpec | None] = [None, None, None]
    if weights is not None:
        for s, name in enumerate(SPLIT_NAMES):
            parts = [specs[p][s] for p in prefixes]
            if all(x is None for x in parts):
                continue
            blends[s] = BlendSpec(
                name=name,
                prefixes=tuple(prefixes),
                weights=tuple(weights),
                size=num_samples[s],
                dataset_descriptions=tuple(x.description() if x else "none" for x in parts),
                cache_dir=default_cache_dir(prefixes[0], data_cache_path),
            )

    # Phase 2 (index builder): write what is not cached yet.
    if is_index_builder:
        for p in prefixes:
            for spec in specs[p]:
                if spec is not None and not spec.is_cached():
                    save_gpt_indices(spec, build_gpt_indices(spec, indexed[p].document_sizes()))
        for blend in blends:
            if blend is not None and not blend.is_cached():
                blend.build_and_save()

    # Phase 3 (all ranks): wait for the builder, then load.
    barrier()
    datasets: list[Dataset | None] = []
    for s in range(3):
        loaded = {p: GPTDataset(specs[p][s], indexed[p]) if specs[p][s] else None for p in prefixes}
        if weights is None:
            datasets.append(loaded[prefixes[0]])
        elif blends[s] is None:
            datasets.append(None)
        else:
            datasets.append(BlendedDataset([loaded[p] for p in prefixes], blends[s]))
    return datasets[0], datasets[1], datasets[2]
