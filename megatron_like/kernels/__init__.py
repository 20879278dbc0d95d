"""Fused kernels (C++ with runtime AVX-512/AVX2 dispatch, built from ``csrc/``) with PyTorch fallbacks.

Every op picks the compiled path for CPU float tensors and a pure-PyTorch implementation of the same
contract otherwise (other devices, missing build, or ``MEGATRON_LIKE_NO_CSRC=1``, read at import and by
``refresh_environment()``). See docs/kernels.md.
"""

from megatron_like.kernels._loader import csrc_available, csrc_disabled, csrc_isa, refresh_environment
from megatron_like.kernels.bias_gelu import bias_gelu
from megatron_like.kernels.cpu_adam import CPUAdam, adam_step_
from megatron_like.kernels.cross_entropy import fused_vocab_cross_entropy
from megatron_like.kernels.fused_softmax import scaled_masked_softmax, scaled_upper_triang_masked_softmax
from megatron_like.kernels.grouped_gemm import grouped_gemm
from megatron_like.kernels.layer_norm import fused_add_layer_norm, layer_norm
from megatron_like.kernels.rms_norm import fused_rms_norm
from megatron_like.kernels.rotary import fused_apply_rotary
from megatron_like.kernels.swiglu import fused_swiglu

__all__ = [
    "CPUAdam",
    "adam_step_",
    "bias_gelu",
    "csrc_available",
    "csrc_disabled",
    "csrc_isa",
    "fused_add_layer_norm",
    "fused_apply_rotary",
    "fused_rms_norm",
    "fused_swiglu",
    "fused_vocab_cross_entropy",
    "grouped_gemm",
    "layer_norm",
    "refresh_environment",
    "scaled_masked_softmax",
    "scaled_upper_triang_masked_softmax",
]
