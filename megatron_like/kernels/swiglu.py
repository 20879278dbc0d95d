"""SwiGLU on interleaved (gate, up) pairs in one pass forward and one backward.

``fused_swiglu(gate_up)`` has the contract of :func:`swiglu_reference` (the model's ``swiglu``): ``gate_up``
``[..., 2 f]`` holds gate feature i at column ``2 i`` and its up feature at ``2 i + 1``, and the result
``[..., f]`` is ``silu(gate) * up`` (silu rounded to the input dtype, then the product). The unfused ops
read the strided halves twice and autograd stacks the two gradients back together; the kernel reads
``gate_up`` once and writes the interleaved gradient directly. Only ``gate_up`` is saved for backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_like.kernels._common import dtype_code, pick_kernel


def swiglu_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """The contract (and the fallback): ``[..., 2 f]`` (gate, up) pairs -> ``[..., f]``, ``silu(gate) * up``."""
    gate, up = gate_up.unflatten(-1, (-1, 2)).unbind(-1)
    return F.silu(gate) * up


class FusedSwiGLU(torch.autograd.Function):
    """y = silu(gate_up[..., 0::2]) * gate_up[..., 1::2]; used only when a compiled kernel takes the tensor."""

    @staticmethod
    def forward(ctx, gate_up: torch.Tensor, module, last_arg: int) -> torch.Tensor:
        gate_up = gate_up.contiguous()
        f = gate_up.shape[-1] // 2
        n = gate_up.numel() // (2 * f)
        y = gate_up.new_empty((*gate_up.shape[:-1], f))
        module.forward(gate_up.data_ptr(), y.data_ptr(), n, f, dtype_code(gate_up.dtype), last_arg)
        ctx.save_for_backward(gate_up)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (gate_up,) = ctx.saved_tensors
        kernel = pick_kernel("swiglu", dy, gate_up)
        if kernel is None:  # the compiled path went away between passes (MEGATRON_LIKE_NO_CSRC set)
            with torch.enable_grad():
                leaf = gate_up.detach().requires_grad_()
                (dgate_up,) = torch.autograd.grad(swiglu_reference(leaf), leaf, dy)
            return dgate_up, None, None
        module, last_arg = kernel
        dy = dy.contiguous()
        f = gate_up.shape[-1] // 2
        dgate_up = torch.empty_like(gate_up)
        module.backward(dy.data_ptr(), gate_up.data_ptr(), dgate_up.data_ptr(), gate_up.numel() // (2 * f), f,
                        dtype_code(gate_up.dtype), last_arg)
        return dgate_up, None, None


def fused_swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """Return ``silu(gate) * up`` of interleaved pairs: ``[..., 2 f]`` -> ``[..., f]`` in ``gate_up``'s dtype."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"fused_swiglu: the last dimension must be even (gate, up) pairs, got {gate_up.shape[-1]}")
    kernel = pick_kernel("swiglu", gate_up) if gate_up.numel() else None
    if kernel is None:
        return swiglu_reference(gate_up)
    return FusedSwiGLU.apply(gate_up, *kernel)
