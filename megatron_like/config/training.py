"""TrainingConfig: batch sizes, length of the run, the seed, the CPU memory setting, and their rules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from megatron_like.config.fields import NON_NEGATIVE, POSITIVE, Range


@dataclass
class TrainingConfig:
    """Batch sizes, length of the run, the seed, and how a CPU process keeps its memory."""

    micro_batch_size: Annotated[int, POSITIVE] = 2
    """Samples per forward/backward pass on one data-parallel rank."""
    global_batch_size: Annotated[int | None, POSITIVE] = None
    """Samples per optimizer step across all data-parallel ranks; defaults to micro batch * dp."""
    train_iters: Annotated[int, NON_NEGATIVE] = 10
    """Optimizer steps to run."""
    seed: Annotated[int, Range(0, 2**32 - 1)] = 1234
    """Seed of weights, dropout and data order; runs with the same seed are identical."""
    keep_freed_memory: bool = True
    """On CPU, glibc keeps freed memory for the next step instead of returning it to the system (as a GPU's
    caching allocator does; megatron_like/training/process_setup.py); --no-keep-freed-memory restores glibc's
    trimming."""

    def validate(self) -> None:
        """Nothing between fields: each field's range is declared on it (fields.py)."""
