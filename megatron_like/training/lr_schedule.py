"""Learning-rate schedule: linear warmup, then constant, linear or cosine decay to ``min_lr``."""

from __future__ import annotations

import math

import torch

from megatron_like.config import OptimizerConfig

SCHEDULE_KEYS = ("max_lr", "min_lr", "warmup_iters", "decay_iters", "decay_style")
"""The values that define the schedule (Megatron's OptimizerParamScheduler checks the same ones on load)."""


def schedule_values(config: OptimizerConfig, train_iters: int) -> dict:
    """The schedule a run's flags define: peak and final lr, warmup and decay lengths (iterations), style."""
    decay_iters = config.lr_decay_iters or train_iters
    if config.lr_warmup_fraction is not None:
        warmup_iters = int(config.lr_warmup_fraction * decay_iters)
    else:
        warmup_iters = config.lr_warmup_iters
    return {"max_lr": config.lr, "min_lr": config.min_lr, "warmup_iters": warmup_iters,
            "decay_iters": decay_iters, "decay_style": config.lr_decay_style}


class LearningRateScheduler:
    """Sets ``lr`` of every param group of ``optimizer`` from the iteration count (Megatron's rule).

    On resume the step count always comes from the checkpoint. The schedule's values come from this
    run's flags, or with ``use_checkpoint_values`` (``--use-checkpoint-opt_param-scheduler``) from the
    checkpoint.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, config: OptimizerConfig, train_iters: int,
                 use_checkpoint_values: bool = False) -> None:
        self.optimizer = optimizer
        self.use_checkpoint_values = use_checkpoint_values
        self._set_values(schedule_values(config, train_iters))
        self.num_steps = 0
        self.step(0)

    def _set_values(self, values: dict) -> None:
        self.max_lr, self.min_lr, self.style = values["max_lr"], values["min_lr"], values["decay_style"]
        self.warmup_iters, self.decay_iters = values["warmup_iters"], values["decay_iters"]

    def values(self) -> dict:
        return {"max_lr": self.max_lr, "min_lr": self.min_lr, "warmup_iters": self.warmup_iters,
                "decay_iters": self.decay_iters, "decay_style": self.style}

    def get_lr(self, step: int) -> float:
        if self.warmup_iters > 0 and step <= self.warmup_iters:
            return self.max_lr * step / self.warmup_iters
        if self.style == "constant":
            return self.max_lr
        if step > self.decay_iters:
            return self.min_lr
        progress = (step - self.warmup_iters) / max(1, self.decay_iters - self.warmup_iters)
        if self.style == "linear":
            coefficient = 1.0 - progress
        else:  # cosine
            coefficient = 0.5 * (math.cos(math.pi * progress) + 1.0)
        return self.min_lr + coefficient * (self.max_lr - self.min_lr)

    def step(self, increment: int = 1) -> float:
        self.num_steps += increment
        lr = self.get_lr(self.num_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, **self.values()}

    def load_state_dict(self, state: dict) -> None:
        self.num_steps = int(state["num_steps"])
        if self.use_checkpoint_values and all(key in state for key in SCHEDULE_KEYS):
            self._set_values(state)
        self.step(0)
