"""LoggingConfig: what is printed and recorded during training, and its rules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from megatron_like.config.fields import NON_NEGATIVE, POSITIVE, Requires


@dataclass
class LoggingConfig:
    """What is printed and recorded during training."""

    log_interval: Annotated[int, POSITIVE] = 100
    """Print the training log line every this many iterations."""
    eval_interval: Annotated[int, POSITIVE] = 1000
    """Evaluate on the validation split every this many iterations."""
    eval_iters: Annotated[int, NON_NEGATIVE] = 100
    """Batches per validation run (0 disables evaluation)."""
    tensorboard_dir: str | None = None
    """Write TensorBoard scalars here."""
    wandb_project: str | None = None
    """Also log to this Weights & Biases project (needs the wandb package)."""
    wandb_exp_name: Annotated[str | None, Requires("wandb_project")] = None
    """Name of the Weights & Biases run (default: chosen by wandb)."""
    log_memory: bool = True
    """Add this rank's peak memory to the log line (--no-log-memory drops it)."""

    def validate(self) -> None:
        """Nothing between fields: each field's range is declared on it (fields.py)."""
