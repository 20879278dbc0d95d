"""Rotary position embedding applied to query or key heads in one pass forward and one backward.

``fused_apply_rotary(x, cos, sin)`` has the contract of :func:`apply_rotary_reference` (the model's ``apply_rotary``):
``x [b, heads, s, head_dim]``, tables ``[s, rotary_dim]`` cast to ``x``'s dtype, the "rotate half"
pairs (i, i + rotary_dim / 2) rotated and ``x[..., rotary_dim:]`` passed through. The unfused ops slice,
negate, concatenate and multiply (six passes, more in backward); the kernel reads each row once, takes
the model's permuted views of the QKV output without a copy and writes a contiguous result. Its backward
is the transposed rotation. Gradients for ``cos``/``sin`` are not computed by the kernel: tables that
require grad take the PyTorch path.
"""

from __future__ import annotations

import torch

from megatron_like.kernels._common import accum_dtype, dtype_code, pick_kernel


def apply_rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The contract (and the fallback): rotate ``x [b, heads, s, head_dim]`` by ``cos, sin [s, rotary_dim]``.

    ``x[..., :rotary_dim]`` becomes ``x * cos + rotate_half(x) * sin`` with ``rotate_half([x1, x2]) =
    [-x2, x1]``; ``x[..., rotary_dim:]`` is unchanged. The tables are cast to ``x``'s dtype first (as
    Megatron-LM), so 16-bit runs rotate in 16-bit.
    """
    rotary_dim = cos.shape[-1]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    rotated, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    x1, x2 = rotated.chunk(2, dim=-1)
    rotated = rotated * cos + torch.cat([-x2, x1], dim=-1) * sin
    return torch.cat([rotated, passed], dim=-1) if passed.shape[-1] else rotated


def _rotate(module, last_arg: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool):
    """Run the kernel on ``x [b, heads, s, hd]`` (unit stride over hd) into a new contiguous tensor."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    b, heads, s, hd = x.shape
    out = torch.empty((b, heads, s, hd), dtype=x.dtype, device=x.device)
    module.apply(x.data_ptr(), x.stride(0), x.stride(1), x.stride(2), cos.data_ptr(), sin.data_ptr(), out.data_ptr(),
                 b, heads, s, hd, cos.shape[-1], backward, dtype_code(x.dtype), last_arg)
    return out


class FusedRotary(torch.autograd.Function):
    """Rotate ``x [b, heads, s, hd]`` by tables ``[s, rd]`` (in x's accumulation dtype, contiguous)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, module, last_arg: int) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate(module, last_arg, x, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        cos, sin = ctx.saved_tensors
        kernel = pick_kernel("rotary", dout)
        if kernel is None:  # the compiled path went away between passes (MEGATRON_LIKE_NO_CSRC set)
            with torch.enable_grad():
                leaf = torch.zeros_like(dout).requires_grad_()
                (dx,) = torch.autograd.grad(apply_rotary_reference(leaf, cos, sin), leaf, dout)
            return dx, None, None, None, None
        return _rotate(*kernel, dout, cos, sin, backward=True), None, None, None, None


def fused_apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [b, heads, s, head_dim]`` by ``cos, sin [s, rotary_dim]``; same shape and dtype as ``x``.

    ``rotary_dim`` may be smaller than ``head_dim`` (the rest passes through). The compiled path takes
    4-d ``x`` and 2-d tables of exactly ``[s, rotary_dim]`` that need no gradient; anything else (other
    broadcasts) runs the PyTorch ops.
    """
    rotary_dim = cos.shape[-1]
    fits = (
        x.dim() == 4 and x.numel() > 0 and cos.shape == sin.shape == (x.shape[2], rotary_dim)
        and rotary_dim % 2 == 0 and rotary_dim <= x.shape[-1] and cos.device == sin.device == x.device
        and not (cos.requires_grad or sin.requires_grad)
    )
    kernel = pick_kernel("rotary", x) if fits else None
    if kernel is None:
        return apply_rotary_reference(x, cos, sin)
    acc = accum_dtype(x.dtype)
    return FusedRotary.apply(x, cos.to(acc).contiguous(), sin.to(acc).contiguous(), *kernel)
