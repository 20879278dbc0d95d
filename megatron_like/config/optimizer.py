"""OptimizerConfig: AdamW, its learning-rate schedule and gradient clipping, and their rules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from megatron_like.config.errors import _require
from megatron_like.config.fields import NON_NEGATIVE, POSITIVE, PROBABILITY, Range


@dataclass
class OptimizerConfig:
    """AdamW, its learning-rate schedule and gradient clipping."""

    lr: Annotated[float, NON_NEGATIVE] = 1e-4
    """Peak learning rate."""
    min_lr: Annotated[float, NON_NEGATIVE] = 0.0
    """Learning rate at the end of the decay."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "linear"
    """Shape of the decay after warmup."""
    lr_decay_iters: Annotated[int | None, POSITIVE] = None
    """Iterations over which the learning rate decays; defaults to --train-iters."""
    lr_warmup_iters: Annotated[int, NON_NEGATIVE] = 0
    """Iterations of linear warmup from 0 to --lr."""
    lr_warmup_fraction: Annotated[float | None, Range(0, 1)] = None
    """Warmup as a fraction of --lr-decay-iters (overrides --lr-warmup-iters)."""
    weight_decay: Annotated[float, NON_NEGATIVE] = 0.01
    """Decoupled weight decay (not applied to biases and LayerNorm parameters)."""
    clip_grad: Annotated[float, NON_NEGATIVE] = 1.0
    """Clip the global gradient norm to this value (0 disables)."""
    adam_beta1: Annotated[float, PROBABILITY] = 0.9
    """Adam beta1."""
    adam_beta2: Annotated[float, PROBABILITY] = 0.999
    """Adam beta2."""
    adam_eps: Annotated[float, POSITIVE] = 1e-8
    """Adam epsilon."""

    def validate(self) -> None:
        """The rules between fields (each field's range is declared on it: fields.py)."""
        _require(self.min_lr <= self.lr, f"--min-lr {self.min_lr} must be in [0, --lr {self.lr}]")
