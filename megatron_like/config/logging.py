"""LoggingConfig: what is printed and recorded during training, and its rules."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_like.config.errors import _require


@dataclass
class LoggingConfig:
    """What is printed and recorded during training."""

    log_interval: int = 100
    """Print the training log line every this many iterations."""
    eval_interval: int = 1000
    """Evaluate on the validation split every this many iterations."""
    eval_iters: int = 100
    """Batches per validation run (0 disables evaluation)."""
    tensorboard_dir: str | None = None
    """Write TensorBoard scalars here."""
    wandb_project: str | None = None
    """Also log to this Weights & Biases project (needs the wandb package)."""
    wandb_exp_name: str | None = None
    """Name of the Weights & Biases run (default: chosen by wandb)."""
    log_memory: bool = True
    """Add this rank's peak memory to the log line (--no-log-memory drops it)."""

    def validate(self) -> None:
        _require(self.log_interval > 0, f"--log-interval {self.log_interval} must be positive")
        _require(self.eval_interval > 0, f"--eval-interval {self.eval_interval} must be positive")
        _require(self.eval_iters >= 0, f"--eval-iters {self.eval_iters} must be >= 0")
