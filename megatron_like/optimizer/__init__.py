"""Optimizer: fp32 master weights over ZeRO shards, fp16 loss scaling, gradient clipping, CPU offload."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from megatron_like.config import OptimizerConfig
from megatron_like.optimizer.clip_grads import clip_grads, global_grad_norm
from megatron_like.optimizer.distributed_optimizer import DistributedOptimizer, StepResult
from megatron_like.optimizer.loss_scaler import DynamicLossScaler, LossScaler, build_loss_scaler


def param_groups(model: Iterable[nn.Module], weight_decay: float) -> list[dict]:
    """Decay matrices; leave biases and LayerNorm parameters (every 1-D tensor) undecayed, as Megatron."""
    decay, no_decay = [], []
    for chunk in model:
        for param in chunk.parameters():
            if param.requires_grad:
                (no_decay if param.ndim == 1 else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(model: Iterable[nn.Module], config: OptimizerConfig) -> torch.optim.Optimizer:
    """Plain AdamW over the model's own parameters and ``.grad`` (no buffers, no sharding).

    Training runs use :class:`DistributedOptimizer`; this is the reference it is checked against.
    """
    groups = param_groups(model, config.weight_decay)
    return torch.optim.AdamW(
        groups,
        lr=config.lr,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_eps,
        fused=True,
    )


__all__ = [
    "DistributedOptimizer",
    "DynamicLossScaler",
    "LossScaler",
    "StepResult",
    "build_loss_scaler",
    "build_optimizer",
    "clip_grads",
    "global_grad_norm",
    "param_groups",
]
