"""Learning-rate schedule: linear warmup, then constant, linear or cosine decay to ``min_lr``."""

from __future__ import annotations

import math

import torch

from megatron_like.config import OptimizerConfig


class LearningRateScheduler:
    """Sets ``lr`` of every param group of ``optimizer`` from the iteration count (Megatron's rule)."""

    def __init__(self, optimizer: torch.optim.Optimizer, config: OptimizerConfig, train_iters: int) -> None:
        self.optimizer = optimizer
        self.max_lr, self.min_lr, self.style = config.lr, config.min_lr, config.lr_decay_style
        self.decay_iters = config.lr_decay_iters or train_iters
        if config.lr_warmup_fraction is not None:
            self.warmup_iters = int(config.lr_warmup_fraction * self.decay_iters)
        else:
            self.warmup_iters = config.lr_warmup_iters
        self.num_steps = 0
        self.step(0)

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
        return {"num_steps": self.num_steps}

    def load_state_dict(self, state: dict) -> None:
        self.num_steps = int(state["num_steps"])
        self.step(0)
