"""OptimizerConfig: AdamW, its learning-rate schedule and gradient clipping, and their rules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_like.config.errors import _require, flag_name


@dataclass
class OptimizerConfig:
    """AdamW, its learning-rate schedule and gradient clipping."""

    lr: float = 1e-4
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "linear"
    """Shape of the decay after warmup."""
    lr_decay_iters: int | None = None
    """Iterations over which the learning rate decays; defaults to --train-iters."""
    lr_warmup_iters: int = 0
    """Iterations of linear warmup from 0 to --lr."""
    lr_warmup_fraction: float | None = None
    """Warmup as a fraction of --lr-decay-iters (overrides --lr-warmup-iters)."""
    weight_decay: float = 0.01
    """Decoupled weight decay (not applied to biases and LayerNorm parameters)."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this value (0 disables)."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""

    def validate(self) -> None:
        _require(self.lr >= 0, f"--lr {self.lr} must be non-negative")
        _require(0 <= self.min_lr <= self.lr, f"--min-lr {self.min_lr} must be in [0, --lr {self.lr}]")
        _require(self.clip_grad >= 0, f"--clip-grad {self.clip_grad} must be non-negative")
        _require(self.lr_warmup_iters >= 0, f"--lr-warmup-iters {self.lr_warmup_iters} must be >= 0")
        if self.lr_warmup_fraction is not None:
            _require(
                0 <= self.lr_warmup_fraction <= 1,
                f"--lr-warmup-fraction {self.lr_warmup_fraction} must be in [0, 1]",
            )
        for name in ("adam_beta1", "adam_beta2"):
            value = getattr(self, name)
            _require(0 <= value < 1, f"{flag_name(name)} {value} must be in [0, 1)")
