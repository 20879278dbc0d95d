"""fp16 loss scaling: the loss is multiplied by ``scale`` before backward so small gradients survive fp16.

The optimizer divides the gradients by ``scale`` again; if any is inf/nan the step is skipped and
:meth:`LossScaler.update` is told so. Megatron's dynamic rule (``DynamicGradScaler``):

* overflow: reset the clean-iteration counter; after ``hysteresis`` overflows (without a growth in
  between) halve the scale, never below ``min_scale``;
* ``window`` clean iterations in a row: double the scale and restore the hysteresis budget.
"""

from __future__ import annotations

from megatron_like.config import PrecisionConfig


class LossScaler:
    """A constant scale (``--loss-scale``); also the interface of the dynamic scaler."""

    def __init__(self, scale: float) -> None:
        self.scale = float(scale)

    def update(self, found_inf: bool) -> None:
        """Record whether this iteration's gradients overflowed (a constant scale ignores it)."""

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])


class DynamicLossScaler(LossScaler):
    """Backs off on overflow (after ``hysteresis`` of them) and grows after ``window`` clean iterations."""

    def __init__(self, initial_scale: float, min_scale: float = 1.0, window: int = 1000, hysteresis: int = 2,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5) -> None:
        super().__init__(initial_scale)
        if min_scale <= 0 or initial_scale < min_scale:
            raise ValueError(f"loss scale {initial_scale} must be >= min loss scale {min_scale} > 0")
        self.min_scale, self.window, self.hysteresis = float(min_scale), window, hysteresis
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_tracker = 0
        self.hysteresis_tracker = hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.window:
            self.growth_tracker = 0
            self.hysteresis_tracker = self.hysteresis
            self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state.get("growth_tracker", 0))
        self.hysteresis_tracker = int(state.get("hysteresis_tracker", self.hysteresis))


def build_loss_scaler(precision: PrecisionConfig) -> LossScaler | None:
    """The scaler for ``--fp16`` (static with ``--loss-scale``, else dynamic); None for fp32 and bf16."""
    if not precision.fp16:
        return None
    if precision.loss_scale is not None:
        return LossScaler(precision.loss_scale)
    return DynamicLossScaler(precision.initial_loss_scale, precision.min_loss_scale,
                             precision.loss_scale_window, precision.hysteresis)
