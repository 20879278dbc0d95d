"""Fused bias + GELU (tanh approximation, as GPT-2 and Megatron's ``bias_gelu``).

``bias_gelu(x, bias)`` returns ``gelu_tanh(x + bias)`` for ``x`` ``[..., h]`` and ``bias`` ``[h]``:
the MLP's first linear layer skips its bias add (Megatron's ``skip_bias_add``) and this op does it
while applying the activation, so the ``[..., ffn]`` activation is read and written once. The
backward saves only ``x`` and ``bias`` and recomputes tanh, then reduces the bias gradient in the
same pass.
"""

from __future__ import annotations

import math

import torch

from megatron_like.kernels._common import dtype_code, pick_kernel

_BETA = math.sqrt(2.0 / math.pi)
_KAPPA = 0.044715


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def _bias_gelu_forward_torch(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Return gelu_tanh(x + bias) with PyTorch ops, in float32 for 16-bit inputs (the fallback)."""
    acc = _compute_dtype(x.dtype)
    u = x.to(acc) + bias.to(acc)
    return torch.nn.functional.gelu(u, approximate="tanh").to(x.dtype)


def _bias_gelu_backward_torch(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Return dy * gelu_tanh'(x + bias), computed in float32/64 (the fallback)."""
    acc = _compute_dtype(x.dtype)
    u = x.to(acc) + bias.to(acc)
    t = torch.tanh(_BETA * (u + _KAPPA * u * u * u))
    du = 0.5 * (1.0 + t) + 0.5 * u * (1.0 - t * t) * _BETA * (1.0 + 3.0 * _KAPPA * u * u)
    return dy.to(acc) * du


class BiasGeLU(torch.autograd.Function):
    """y = gelu_tanh(x + bias) for ``x`` ``[..., h]``, ``bias`` ``[h]``: the compiled kernel (CPU, or the CUDA twin
    ``csrc/cuda/bias_gelu.cu``) when one takes the tensors, else the PyTorch ops in float32."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        kernel = pick_kernel("bias_gelu", x, bias)
        if kernel is not None:
            module, last_arg = kernel
            x = x.contiguous()
            bias = bias.contiguous()
            y = torch.empty_like(x)
            h = x.shape[-1]
            module.forward(x.data_ptr(), bias.data_ptr(), y.data_ptr(), x.numel() // h, h, dtype_code(x.dtype),
                           last_arg)
        else:
            y = _bias_gelu_forward_torch(x, bias)
        ctx.save_for_backward(x, bias)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        x, bias = ctx.saved_tensors
        need_bias_grad = ctx.needs_input_grad[1]
        kernel = pick_kernel("bias_gelu", dy, x, bias)
        if kernel is None:
            dx = _bias_gelu_backward_torch(dy, x, bias)
            dbias = dx.reshape(-1, x.shape[-1]).sum(dim=0).to(bias.dtype) if need_bias_grad else None
            return dx.to(x.dtype), dbias
        module, last_arg = kernel
        dy = dy.contiguous()
        dx = torch.empty_like(x)
        dbias = torch.empty_like(bias) if need_bias_grad else None
        h = x.shape[-1]
        module.backward(dy.data_ptr(), x.data_ptr(), bias.data_ptr(), dx.data_ptr(),
                        0 if dbias is None else dbias.data_ptr(), x.numel() // h, h, dtype_code(x.dtype), last_arg)
        return dx, dbias


def bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Return ``gelu_tanh(x + bias)``.

    Args:
        x: ``[..., h]`` pre-activation without its bias (float32, bfloat16, float16 or float64).
        bias: ``[h]``.

    Returns:
        ``[..., h]`` in ``x.dtype``.
    """
    if bias.dim() != 1 or bias.shape[0] != x.shape[-1]:
        raise ValueError(f"bias_gelu: bias must be [{x.shape[-1]}], got {tuple(bias.shape)}")
    return BiasGeLU.apply(x, bias)
