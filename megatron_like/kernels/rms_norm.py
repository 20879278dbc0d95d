"""RMSNorm over the last dimension (Llama's normalization) in one pass forward and one backward.

``fused_rms_norm(x, weight, eps)`` has the contract of :func:`rms_norm_reference` (the model's ``rms_norm``): the
statistics are float32 (float64 for float64 input), the normalized row is cast to ``x``'s dtype and then
multiplied by the weight. The kernel saves only ``x`` and the per-row ``rstd`` and reduces the weight
gradient over rows in the same backward pass; the PyTorch path runs those same ops under autograd.
"""

from __future__ import annotations

import torch

from megatron_like.kernels._common import accum_dtype, dtype_code, pick_kernel


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The contract (and the fallback): ``x / sqrt(mean(x^2) + eps) * weight`` over the last dim ``[..., h]``,
    statistics in float32 (float64 for float64), the normalized rows cast to ``x``'s dtype before the weight."""
    xa = x.to(accum_dtype(x.dtype))
    normalized = xa * torch.rsqrt(xa.pow(2).mean(-1, keepdim=True) + eps)
    return normalized.to(x.dtype) * weight


class FusedRMSNorm(torch.autograd.Function):
    """out = round(x * rstd) * weight over rows ``[n, h]``; used only when a compiled kernel takes the tensors."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, module, last_arg: int) -> torch.Tensor:
        h = x.shape[-1]
        n = x.numel() // h
        x, weight = x.contiguous(), weight.contiguous()
        out = torch.empty_like(x)
        rstd = torch.empty(n, dtype=accum_dtype(x.dtype), device=x.device)
        module.forward(x.data_ptr(), weight.data_ptr(), out.data_ptr(), rstd.data_ptr(), n, h, float(eps),
                       dtype_code(x.dtype), last_arg)
        ctx.save_for_backward(x, weight, rstd)
        ctx.eps = eps
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        h = x.shape[-1]
        n = x.numel() // h
        kernel = pick_kernel("rms_norm", dout, x, weight)
        if kernel is None:  # the compiled path went away between passes (MEGATRON_LIKE_NO_CSRC set)
            with torch.enable_grad():
                xg, wg = x.detach().requires_grad_(), weight.detach().requires_grad_()
                dx, dweight = torch.autograd.grad(rms_norm_reference(xg, wg, ctx.eps), (xg, wg), dout)
            return dx, dweight if ctx.needs_input_grad[1] else None, None, None, None
        module, last_arg = kernel
        dout = dout.contiguous()
        dx = torch.empty_like(x)
        dweight = torch.empty_like(weight) if ctx.needs_input_grad[1] else None
        module.backward(dout.data_ptr(), x.data_ptr(), weight.data_ptr(), rstd.data_ptr(), dx.data_ptr(),
                        0 if dweight is None else dweight.data_ptr(), n, h, dtype_code(x.dtype), last_arg)
        return dx, dweight, None, None, None


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Return ``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension.

    Args:
        x: ``[..., h]`` (float32, bfloat16, float16 or float64).
        weight: ``[h]``; same dtype as ``x`` for the compiled path (else the PyTorch ops run).
        eps: added to the mean square.

    Returns:
        ``[..., h]`` like ``x``.
    """
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"fused_rms_norm: weight must be [{x.shape[-1]}], got {tuple(weight.shape)}")
    kernel = pick_kernel("rms_norm", x, weight) if x.numel() else None
    if kernel is None:
        return rms_norm_reference(x, weight, eps)
    return FusedRMSNorm.apply(x, weight, eps, *kernel)
