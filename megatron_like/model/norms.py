"""The normalization layers of the transformer: LayerNorm (GPT-2/3) or RMSNorm (Llama), by --normalization.

Both are replicated over tensor parallelism. With sequence parallelism each tp rank normalizes only its
sequence shard, so the weight gradient on each rank is a partial sum over that shard: the parameters are
tagged ``sequence_parallel`` and the gradient is all-reduced over tp after backward (see
``mark_replicated``).
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


def build_norm(config: ModelConfig, sequence_parallel: bool, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """The model's --normalization over ``hidden_size``, its parameters tagged for the sequence-parallel
    gradient all-reduce."""
    h = config.hidden_size
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
