"""PrecisionConfig: the parameter/activation dtype and fp16 loss scaling, and their rules."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_like.config.errors import _require


@dataclass
class PrecisionConfig:
    """Parameter/activation dtype and fp16 loss scaling."""

    fp16: bool = False
    """Half-precision (fp16) parameters and activations with fp32 master weights and loss scaling."""
    bf16: bool = False
    """bfloat16 parameters and activations with fp32 master weights."""
    loss_scale: float | None = None
    """Static fp16 loss scale; without it the scale is dynamic."""
    initial_loss_scale: float = 2.0**32
    """First dynamic loss scale."""
    min_loss_scale: float = 1.0
    """The dynamic loss scale never backs off below this."""
    loss_scale_window: int = 1000
    """Clean iterations before the dynamic loss scale doubles."""
    hysteresis: int = 2
    """Overflowing iterations tolerated before the dynamic loss scale halves."""

    def validate(self) -> None:
        _require(not (self.fp16 and self.bf16), "--fp16 and --bf16 are exclusive: pick one")
        if self.loss_scale is not None:
            _require(self.loss_scale > 0, f"--loss-scale {self.loss_scale} must be positive")
        _require(self.loss_scale_window > 0, f"--loss-scale-window {self.loss_scale_window} must be > 0")
        _require(self.hysteresis > 0, f"--hysteresis {self.hysteresis} must be positive")
