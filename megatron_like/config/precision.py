"""PrecisionConfig: the parameter/activation dtype and fp16 loss scaling, and their rules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from megatron_like.config.errors import _require
from megatron_like.config.fields import POSITIVE, Requires

# The dynamic loss scaler exists only with --fp16: given with bf16 or fp32 these flags would silently do nothing.
NEEDS_FP16 = Requires("fp16")


@dataclass
class PrecisionConfig:
    """Parameter/activation dtype and fp16 loss scaling."""

    fp16: bool = False
    """Half-precision (fp16) parameters and activations with fp32 master weights and loss scaling."""
    bf16: bool = False
    """bfloat16 parameters and activations with fp32 master weights."""
    loss_scale: Annotated[float | None, POSITIVE] = None
    """Static fp16 loss scale; without it the scale is dynamic."""
    initial_loss_scale: Annotated[float, POSITIVE, NEEDS_FP16] = 2.0**32
    """First dynamic loss scale."""
    min_loss_scale: Annotated[float, POSITIVE, NEEDS_FP16] = 1.0
    """The dynamic loss scale never backs off below this."""
    loss_scale_window: Annotated[int, POSITIVE, NEEDS_FP16] = 1000
    """Clean iterations before the dynamic loss scale doubles."""
    hysteresis: Annotated[int, POSITIVE, NEEDS_FP16] = 2
    """Overflowing iterations tolerated before the dynamic loss scale halves."""

    def validate(self) -> None:
        _require(not (self.fp16 and self.bf16), "--fp16 and --bf16 are exclusive: pick one")
