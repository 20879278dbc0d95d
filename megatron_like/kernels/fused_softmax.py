"""Fused scale + mask + softmax over attention scores, general-mask and causal variants.

Megatron semantics: scores ``x`` are ``[b, np, sq, sk]``; the result is
``softmax(scale * x)`` over the last dimension with masked positions removed (probability 0). A
boolean mask of shape ``[b or 1, 1, sq, sk]`` marks positions to drop with True; the causal variant
drops key ``j > i`` for query ``i``. A row whose keys are all masked returns zeros (and a zero
gradient), like Megatron's CUDA kernels, rather than the NaNs of a softmax over ``-inf``.

bf16/fp16 inputs are exponentiated and summed in fp32 and the probabilities stored back in the input
dtype. The C++ path (``csrc/softmax_kernels.h``) runs for CPU float tensors, the CUDA twin
(``csrc/cuda/softmax.cuh``, when built) for CUDA tensors; everything else runs the
PyTorch fallback below, which has the same numerics contract.
"""

from __future__ import annotations

import torch

from megatron_like.kernels._common import dtype_code, pick_kernel


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def _softmax_forward_torch(x: torch.Tensor, mask: torch.Tensor | None, scale: float, causal: bool) -> torch.Tensor:
    """Return the masked softmax of ``x`` ``[..., sq, sk]`` with PyTorch ops (the fallback)."""
    scores = x.to(_compute_dtype(x.dtype)) * scale
    if causal:
        sq, sk = x.shape[-2:]
        mask = torch.ones(sq, sk, dtype=torch.bool, device=x.device).triu(1)
    if mask is not None:
        mask = mask.bool()
        scores = scores.masked_fill(mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if mask is not None and not causal:
        probs = probs.masked_fill(mask.all(dim=-1, keepdim=True), 0.0)
    return probs.to(x.dtype)


def _softmax_backward_torch(dy: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
    """Return ``scale * y * (dy - sum(dy * y))`` over the last dimension (the fallback)."""
    dyc = dy.to(_compute_dtype(dy.dtype))
    yc = y.to(dyc.dtype)
    return (scale * yc * (dyc - (dyc * yc).sum(dim=-1, keepdim=True))).to(dy.dtype)


def _canonical_mask(mask: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
    """Return ``mask`` as contiguous uint8 ``[b or 1, 1, sq, sk]`` for the kernel, None if unsupported."""
    b, _, sq, sk = x.shape
    if mask.dim() == 2:
        mask = mask.view(1, 1, *mask.shape)
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2:] != (sq, sk) or mask.shape[0] not in (1, b):
        return None
    if mask.device != x.device:  # the kernel (C++ or its CUDA twin) reads the mask where x lives
        return None
    mask = mask.contiguous()
    return mask.view(torch.uint8) if mask.dtype == torch.bool else (mask != 0).view(torch.uint8)


class ScaledMaskedSoftmax(torch.autograd.Function):
    """y = softmax(scale * x, masked) over ``x`` ``[b, np, sq, sk]``; saves only y for backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
        kernel = pick_kernel("scaled_masked_softmax", x)
        kernel_mask = _canonical_mask(mask, x) if (kernel is not None and mask is not None) else None
        if kernel is not None and (mask is None or kernel_mask is not None):
            module, last_arg = kernel
            x = x.contiguous()
            y = torch.empty_like(x)
            b, np_, sq, sk = x.shape
            mask_ptr = 0 if kernel_mask is None else kernel_mask.data_ptr()
            mask_batches = 1 if kernel_mask is None else kernel_mask.shape[0]
            module.forward(
                x.data_ptr(),
                mask_ptr,
                y.data_ptr(),
                b,
                np_,
                sq,
                sk,
                mask_batches,
                float(scale),
                dtype_code(x.dtype),
                last_arg,
            )
        else:
            y = _softmax_forward_torch(x, mask, scale, causal=False)
        ctx.save_for_backward(y)
        ctx.scale = float(scale)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (y,) = ctx.saved_tensors
        kernel = pick_kernel("scaled_masked_softmax", dy, y)
        if kernel is None:
            return _softmax_backward_torch(dy, y, ctx.scale), None, None
        module, last_arg = kernel
        dy = dy.contiguous()
        dx = torch.empty_like(y)
        sk = y.shape[-1]
        module.backward(
            dy.data_ptr(), y.data_ptr(), dx.data_ptr(), y.numel() // sk, sk, ctx.scale, dtype_code(y.dtype), last_arg
        )
        return dx, None, None


class ScaledUpperTriangMaskedSoftmax(torch.autograd.Function):
    """Causal y = softmax(scale * x) over ``x`` ``[..., sq, sk]`` with sq == sk; saves only y."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        kernel = pick_kernel("scaled_upper_triang_masked_softmax", x)
        if kernel is not None:
            module, last_arg = kernel
            x = x.contiguous()
            y = torch.empty_like(x)
            sq, sk = x.shape[-2:]
            module.forward(
                x.data_ptr(), y.data_ptr(), x.numel() // sk, sq, sk, float(scale), dtype_code(x.dtype), last_arg
            )
        else:
            y = _softmax_forward_torch(x, None, scale, causal=True)
        ctx.save_for_backward(y)
        ctx.scale = float(scale)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, None]:
        (y,) = ctx.saved_tensors
        kernel = pick_kernel("scaled_upper_triang_masked_softmax", dy, y)
        if kernel is None:
            # Above the diagonal y == 0, so the general formula already gives zeros there.
            return _softmax_backward_torch(dy, y, ctx.scale), None
        module, last_arg = kernel
        dy = dy.contiguous()
        dx = torch.empty_like(y)
        sq, sk = y.shape[-2:]
        module.backward(
            dy.data_ptr(),
            y.data_ptr(),
            dx.data_ptr(),
            y.numel() // sk,
            sq,
            sk,
            ctx.scale,
            dtype_code(y.dtype),
            last_arg,
        )
        return dx, None


def scaled_masked_softmax(x: torch.Tensor, mask: torch.Tensor | None, scale: float = 1.0) -> torch.Tensor:
    """Return softmax(scale * x) over the last dim with ``mask`` True entries removed.

    Args:
        x: attention scores ``[b, np, sq, sk]`` (float32, bfloat16, float16 or float64).
        mask: bool ``[b or 1, 1, sq, sk]`` (or ``[sq, sk]``), True = masked out; None for no mask.
            Other broadcastable shapes work through the PyTorch fallback.
        scale: multiplier applied to the scores before the softmax (e.g. 1/sqrt(head_dim)).

    Returns:
        probabilities ``[b, np, sq, sk]`` in ``x.dtype``; rows with every key masked are all zero.
    """
    if x.dim() != 4:
        raise ValueError(f"scaled_masked_softmax expects scores [b, np, sq, sk], got shape {tuple(x.shape)}")
    if mask is not None and mask.dtype.is_floating_point:
        raise TypeError("scaled_masked_softmax takes a boolean mask (True = masked out), not an additive one")
    return ScaledMaskedSoftmax.apply(x, mask, scale)


def scaled_upper_triang_masked_softmax(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Return the causal softmax(scale * x): query ``i`` attends to keys ``j <= i``.

    Args:
        x: attention scores ``[b, np, sq, sk]`` (or ``[b * np, sq, sk]``) with ``sq == sk``.
        scale: multiplier applied to the scores before the softmax.

    Returns:
        probabilities shaped like ``x``, exactly zero above the diagonal.
    """
    if x.dim() < 2 or x.shape[-1] != x.shape[-2]:
        raise ValueError(f"scaled_upper_triang_masked_softmax needs square [..., sq, sk] scores, got {tuple(x.shape)}")
    return ScaledUpperTriangMaskedSoftmax.apply(x, scale)
