"""The normalization layers of the transformer: LayerNorm (GPT-2/3) or RMSNorm (Llama), by --normalization.

Both are replicated over tensor parallelism. With sequence parallelism each tp rank normalizes only its
sequence shard, so the weight gradient on each rank is a partial sum over that shard: the parameters are
tagged ``sequence_parallel`` and the gradient is all-reduced over tp after backward (see
``mark_replicated``).

``--qk-layernorm`` (Qwen3) adds one norm over ``head_dim`` for the query heads and one for the key heads
(:func:`build_head_norm`). Tensor parallelism splits the heads, so each tp rank's gradient of those weights is
a partial sum over its own heads, with or without sequence parallelism: they are always tagged for the tp
all-reduce when tp > 1.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron_like.config import ModelConfig
from megatron_like.kernels import fused_rms_norm
from megatron_like.kernels.rms_norm import rms_norm_reference as rms_norm  # noqa: F401 (the contract)
from megatron_like.tensor_parallel import mark_replicated, new_parameter, zeros_parameter


class RMSNorm(nn.Module):
    """Root-mean-square normalization with a learned scale (no mean subtraction, no bias)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = new_parameter((hidden_size,), dtype, device, lambda out: out.fill_(1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused_rms_norm(x, self.weight, self.eps)


def build_norm(config: ModelConfig, sequence_parallel: bool, dtype: torch.dtype, device: torch.device,
               size: int | None = None) -> nn.Module:
    """The model's --normalization over ``size`` features (default ``hidden_size``); ``sequence_parallel`` tags
    its parameters for the gradient all-reduce over tp (their gradient on one rank is a partial sum)."""
    h = size or config.hidden_size
    # Parameters from new_parameter (ones and zeros): filled now, or at ZeRO-3 when their unit is sharded
    # (tensor_parallel/initialization.py); the LayerNorm module itself is built on the meta device.
    if config.normalization == "RMSNorm":
        norm = RMSNorm(h, config.norm_epsilon, dtype, device)
    else:
        norm = nn.LayerNorm(h, eps=config.norm_epsilon, device="meta")
        norm.weight = new_parameter((h,), dtype, device, lambda out: out.fill_(1.0))
        norm.bias = zeros_parameter((h,), dtype, device)
    for param in norm.parameters():
        mark_replicated(param, sequence_parallel)
    return norm


def build_head_norm(config: ModelConfig, tp_size: int, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """The --qk-layernorm norm over one head's ``head_dim`` features, shared by every head of the layer.

    Each tp rank applies it to its ``heads / tp`` heads only, so its weight gradient there is a partial sum over
    those heads: tagged for the tp all-reduce (the one sequence-parallel norms use) whenever tp > 1.
    """
    return build_norm(config, tp_size > 1, dtype, device, size=config.head_dim)
