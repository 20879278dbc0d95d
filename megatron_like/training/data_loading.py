"""Batch sampling: which samples each data-parallel rank reads for each micro batch.

Megatron's ``MegatronPretrainingSampler``: the global batch ``[c, c + global_batch)`` (``c`` = samples
consumed so far) is read as consecutive chunks of ``micro_batch * dp`` samples, and data-parallel rank
``r`` takes the r-th ``micro_batch`` slice of each chunk. Resuming at ``consumed_samples`` continues
exactly where the previous run stopped.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch


class PretrainingSampler:
    """Yields lists of ``micro_batch_size`` sample indices for one data-parallel rank, in order."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int) -> None:
        if total_samples <= 0:
            raise ValueError("the dataset holds no samples")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"data-parallel rank {dp_rank} outside [0, {dp_size})")
        self.total_samples, self.consumed_samples = total_samples, consumed_samples
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size

    def __len__(self) -> int:
        return (self.total_samples - self.consumed_samples) // (self.micro_batch_size * self.dp_size)

    def __iter__(self) -> Iterator[list[int]]:
        chunk = self.micro_batch_size * self.dp_size
        start = self.dp_rank * self.micro_batch_size
        for first in range(self.consumed_samples, self.total_samples - chunk + 1, chunk):
            yield list(range(first + start, first + start + self.micro_batch_size))


def collate_samples(samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Stack the per-sample numpy arrays into ``[b, ...]`` int64 tensors."""
    return {key: torch.from_numpy(np.stack([s[key] for s in samples]).astype(np.int64)) for key in samples[0]}


def build_data_iterator(dataset: Any | None, consumed_samples: int, micro_batch_size: int,
                        dp_rank: int, dp_size: int, num_workers: int) -> Iterator | None:
    """An iterator of micro batches for this rank, or None when there is no dataset."""
    if dataset is None or len(dataset) == 0:
        return None
    sampler = PretrainingSampler(len(dataset), consumed_samples, micro_batch_size, dp_rank, dp_size)
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        collate_fn=collate_samples,
        persistent_workers=num_workers > 0,
    )
    return iter(loader)
