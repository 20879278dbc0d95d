"""Batch samplers that resume at a consumed-sample count (Megatron's ``MegatronPretrainingSampler``)."""

from __future__ import annotations

from collections.abc import Iterator

import torch


class PretrainingSampler:
    """Yield this data-parallel rank's micro-batch of sample indices, in order, from ``consumed_samples``.

    Global micro-batch k covers samples ``[start + k*m*dp, start + (k+1)*m*dp)`` (m = micro batch size,
    dp = data-parallel size); rank r takes its ``[r*m, (r+1)*m)`` slice of it. An incomplete last
    global micro-batch is dropped so every rank runs the same number of steps.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_world_size: int,
    ) -> None:
        if total_samples <= 0:
            raise ValueError(f"no samples to draw from (total_samples={total_samples})")
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"data-parallel rank {dp_rank} outside a group of {dp_world_size}")
        if micro_batch_size <= 0:
            raise ValueError(f"--micro-batch-size {micro_batch_size} must be positive")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.global_micro_batch = micro_batch_size * dp_world_size

    def __len__(self) -> int:
        """Return the micro-batches left for this rank."""
        return max(0, self.total_samples - self.consumed_samples) // self.global_micro_batch

    def __iter__(self) -> Iterator[list[int]]:
        start = self.dp_rank * self.micro_batch_size
        for first in range(
            self.consumed_samples, self.total_samples - self.global_micro_batch + 1, self.global_micro_batch
        ):
            yield list(range(first + start, first + start + self.micro_batch_size))


def build_pretraining_data_loader(
    dataset: torch.utils.data.Dataset | None,
    consumed_samples: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_world_size: int,
    num_workers: int = 0,
    pin_memory: bool = False,
) -> torch.utils.data.DataLoader | None:
    """Return a DataLoader of {"text": long [micro_batch, seq_length + 1]} from ``consumed_samples`` on.

    ``pin_memory``: page-locked batches (for a GPU run: faster host-to-device copies, as Megatron does).
    """
    if dataset is None:
        return None
    sampler = PretrainingSampler(len(dataset), consumed_samples, micro_batch_size, dp_rank, dp_world_size)
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
        # Every iterator draws a worker base seed from this generator. Without a private one it would
        # draw from the global torch RNG, so building the iterator after a checkpoint restored that RNG
        # would shift every later dropout mask and break exact resumption.
        generator=torch.Generator().manual_seed(consumed_samples),
    )
