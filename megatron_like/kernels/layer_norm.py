"""LayerNorm over the last dimension, optionally fused with the residual add in front of it.

``fused_add_layer_norm(x, residual, weight, bias, x_bias=...)`` computes ``s = x + x_bias + residual``
and ``LayerNorm(s)`` in one pass over the row and returns both (``s`` is the next residual stream),
the pre-LN transformer pattern ``h = h + attn(...); ln(h)`` when no dropout sits in between. Its
backward returns one tensor for both ``x`` and ``residual`` and reduces ``x_bias``'s gradient in the
same pass. Statistics (mean, rstd) are float32 (float64 for float64 input) and saved for backward.
"""

from __future__ import annotations

import torch

from megatron_like.kernels._common import accum_dtype, dtype_code, pick_kernel


def _layer_norm_forward_torch(
    s: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (out, mean [n], rstd [n]) of ``s`` ``[n, h]`` computed in float32/64 (the fallback)."""
    acc = accum_dtype(s.dtype)
    out, mean, rstd = torch.native_layer_norm(s.to(acc), (s.shape[-1],), weight.to(acc), bias.to(acc), eps)
    return out.to(s.dtype), mean.view(-1), rstd.view(-1)


def _layer_norm_backward_torch(
    dy: torch.Tensor, s: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (ds, dweight, dbias) for ``[n, h]`` rows, computed in float32/64 (the fallback)."""
    acc = accum_dtype(s.dtype)
    w = weight.to(acc)
    # The op wants a bias tensor only to size dbias; its values do not enter any gradient.
    ds, dw, db = torch.ops.aten.native_layer_norm_backward(
        dy.to(acc),
        s.to(acc),
        [s.shape[-1]],
        mean.view(-1, 1),
        rstd.view(-1, 1),
        w,
        torch.zeros_like(w),
        [True, True, True],
    )
    return ds, dw, db


class FusedAddLayerNorm(torch.autograd.Function):
    """(out, s) = (LN(s) * weight + bias, s) with s = x + x_bias + residual; rows are ``[n, h]``."""

    @staticmethod
    def forward(ctx, x, x_bias, residual, weight, bias, eps: float, return_sum: bool):
        h = x.shape[-1]
        n = x.numel() // h if h else 0
        fused = x_bias is not None or residual is not None
        kernel = pick_kernel("layer_norm", x, x_bias, residual, weight, bias)
        if kernel is not None:
            module, last_arg = kernel
            x = x.contiguous()
            residual = residual.contiguous() if residual is not None else None
            out = torch.empty_like(x)
            s = torch.empty_like(x) if fused else x
            mean = torch.empty(n, dtype=accum_dtype(x.dtype), device=x.device)
            rstd = torch.empty_like(mean)
            module.forward(
                x.data_ptr(),
                0 if x_bias is None else x_bias.contiguous().data_ptr(),
                0 if residual is None else residual.data_ptr(),
                weight.contiguous().data_ptr(),
                bias.contiguous().data_ptr(),
                out.data_ptr(),
                s.data_ptr() if fused else 0,
                mean.data_ptr(),
                rstd.data_ptr(),
                n,
                h,
                float(eps),
                dtype_code(x.dtype),
                last_arg,
            )
        else:
            s = x
            if x_bias is not None:
                s = s + x_bias
            if residual is not None:
                s = s + residual
            out, mean, rstd = _layer_norm_forward_torch(s.reshape(n, h), weight, bias, eps)
            out = out.view_as(x)
        ctx.save_for_backward(s, weight, mean, rstd)
        ctx.has_x_bias = x_bias is not None
        ctx.has_residual = residual is not None
        ctx.input_dtypes = (x.dtype, weight.dtype, bias.dtype)
        if return_sum:
            return out, s
        return out

    @staticmethod
    def backward(ctx, dout, dsum=None):
        s, weight, mean, rstd = ctx.saved_tensors
        h = s.shape[-1]
        n = s.numel() // h if h else 0
        kernel = pick_kernel("layer_norm", dout, dsum, s, weight)
        dx_bias = None
        if kernel is not None:
            module, last_arg = kernel
            dout = dout.contiguous()
            dsum = dsum.contiguous() if dsum is not None else None
            ds = torch.empty_like(s)
            dweight = torch.empty_like(weight)
            dbias = torch.empty_like(weight)
            dx_bias = torch.empty_like(weight) if ctx.has_x_bias else None
            module.backward(
                dout.data_ptr(),
                0 if dsum is None else dsum.data_ptr(),
                s.data_ptr(),
                weight.contiguous().data_ptr(),
                mean.data_ptr(),
                rstd.data_ptr(),
                ds.data_ptr(),
                dweight.data_ptr(),
                dbias.data_ptr(),
                0 if dx_bias is None else dx_bias.data_ptr(),
                n,
                h,
                dtype_code(s.dtype),
                last_arg,
            )
        else:
            ds, dweight, dbias = _layer_norm_backward_torch(dout.reshape(n, h), s.reshape(n, h), weight, mean, rstd)
            if dsum is not None:
                ds = ds + dsum.reshape(n, h)
            if ctx.has_x_bias:
                dx_bias = ds.sum(dim=0).to(ctx.input_dtypes[0])
            ds = ds.view(s.shape).to(ctx.input_dtypes[0])
            dweight = dweight.to(ctx.input_dtypes[1])
            dbias = dbias.to(ctx.input_dtypes[2])
        dresidual = ds if ctx.has_residual else None
        return ds, dx_bias, dresidual, dweight, dbias, None, None


def _affine(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None):
    h = x.shape[-1]
    if weight is None:
        weight = torch.ones(h, dtype=x.dtype, device=x.device)
    if bias is None:
        bias = torch.zeros(h, dtype=weight.dtype, device=x.device)
    return weight, bias


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float = 1e-5
) -> torch.Tensor:
    """Return LayerNorm(x) * weight + bias over the last dimension.

    Args:
        x: ``[..., h]`` (float32, bfloat16, float16 or float64).
        weight, bias: ``[h]``; None means 1 / 0 (their gradient is then not computed for you).
        eps: added to the variance.
    """
    weight, bias = _affine(x, weight, bias)
    return FusedAddLayerNorm.apply(x, None, None, weight, bias, eps, False)


def fused_add_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    x_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(LayerNorm(s) * weight + bias, s)`` with ``s = x + x_bias + residual``.

    Args:
        x: ``[..., h]``, e.g. the output of a linear layer whose bias was not yet added.
        residual: ``[..., h]`` like ``x``, or None.
        weight, bias: LayerNorm affine parameters ``[h]`` (None = 1 / 0).
        eps: added to the variance.
        x_bias: ``[h]`` bias added to ``x`` (Megatron's skipped linear bias), or None.

    Returns:
        the normalized ``[..., h]`` and the sum ``s`` ``[..., h]`` (the new residual stream).
    """
    weight, bias = _affine(x, weight, bias)
    if residual is None and x_bias is None:
        return FusedAddLayerNorm.apply(x, None, None, weight, bias, eps, False), x
    return FusedAddLayerNorm.apply(x, x_bias, residual, weight, bias, eps, True)
