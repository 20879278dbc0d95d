"""TrainingConfig: batch sizes, length of the run and the seed, and their rules."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_like.config.errors import _require


@dataclass
class TrainingConfig:
    """Batch sizes, length of the run and the seed."""

    micro_batch_size: int = 2
    """Samples per forward/backward pass on one data-parallel rank."""
    global_batch_size: int | None = None
    """Samples per optimizer step across all data-parallel ranks; defaults to micro batch * dp."""
    train_iters: int = 10
    """Optimizer steps to run."""
    seed: int = 1234
    """Seed of weights, dropout and data order; runs with the same seed are identical."""

    def validate(self) -> None:
        _require(self.micro_batch_size > 0, f"--micro-batch-size {self.micro_batch_size} must be positive")
        _require(self.train_iters >= 0, f"--train-iters {self.train_iters} must be >= 0")
