"""Grouped GEMM: one matrix product per expert over the experts' contiguous row groups, in one call.

``grouped_gemm(x, w, tokens_per_expert)`` multiplies rows ``[o_e, o_e + c_e)`` of ``x [T, k]`` by
``w[e] [k, n]`` for every expert ``e`` (``c = tokens_per_expert``, ``o`` its exclusive cumulative sum), as
after the token permutation of a mixture-of-experts layer (``megatron_like/model/moe/permutation.py``).
The C++ path runs all groups, forward and both gradients, in one call: no Python loop over experts and
no per-group tensor views. Products accumulate in fp32 (fp64 for fp64) and are rounded to the input
dtype once. The fallback, :func:`grouped_gemm_reference`, is the loop over experts with ``torch.mm``.
"""

from __future__ import annotations

import torch

from megatron_like.kernels._common import dtype_code, pick_kernel

FORWARD, GRAD_INPUT, GRAD_WEIGHT = 0, 1, 2
"""The ``op`` codes of ``megatron_like._csrc.grouped_gemm.run`` (``GroupedOp`` in csrc/grouped_gemm_kernels.h)."""


def check_grouped_gemm_args(x: torch.Tensor, w: torch.Tensor, tokens_per_expert: torch.Tensor) -> None:
    """Raise a one-line ValueError when the shapes, dtypes or group sizes do not fit together."""
    if x.dim() != 2 or w.dim() != 3:
        raise ValueError(f"grouped_gemm: x must be [T, k] and w [E, k, n], got x {tuple(x.shape)} and w "
                         f"{tuple(w.shape)}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"grouped_gemm: x has k={x.shape[1]} columns but w is [E, {w.shape[1]}, n]: "
                         "pass the weights as [experts, in_features, out_features]")
    if x.dtype != w.dtype:
        raise ValueError(f"grouped_gemm: x is {x.dtype} but w is {w.dtype}: cast one of them")
    if tokens_per_expert.device.type != "cpu" or tokens_per_expert.dtype != torch.int64:
        raise ValueError(f"grouped_gemm: tokens_per_expert must be a CPU int64 tensor, got "
                         f"{tokens_per_expert.dtype} on {tokens_per_expert.device} (the sizes are needed on the host)")
    if tokens_per_expert.shape != (w.shape[0],):
        raise ValueError(f"grouped_gemm: tokens_per_expert must have one entry per expert ({w.shape[0]}), got shape "
                         f"{tuple(tokens_per_expert.shape)}")
    if bool((tokens_per_expert < 0).any()) or int(tokens_per_expert.sum()) != x.shape[0]:
        raise ValueError(f"grouped_gemm: tokens_per_expert {tokens_per_expert.tolist()} must be >= 0 and sum to "
                         f"the {x.shape[0]} rows of x")


def grouped_gemm_reference(x: torch.Tensor, w: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """The contract (and the fallback): ``[T, k]``, ``[E, k, n]``, counts ``[E]`` -> ``[T, n]``, by a loop of mm.

    Accumulation is in fp32 for 16-bit inputs (what ``torch.mm`` does on every backend we run on).
    """
    groups = x.split(tokens_per_expert.tolist())
    out = [torch.mm(rows, w[e]) for e, rows in enumerate(groups)]
    return torch.cat(out) if out else x.new_zeros(0, w.shape[2])


class GroupedGemm(torch.autograd.Function):
    """y = x w_e per row group; used only when a compiled kernel takes the tensors."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, module, last_arg: int) -> torch.Tensor:
        x, w = x.contiguous(), w.contiguous()
        experts, k, n = w.shape
        y = x.new_empty(x.shape[0], n)
        module.run(FORWARD, x.data_ptr(), w.data_ptr(), y.data_ptr(), counts.data_ptr(), experts, k, n,
                   dtype_code(x.dtype), last_arg)
        ctx.save_for_backward(x, w, counts)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, w, counts = ctx.saved_tensors
        kernel = pick_kernel("grouped_gemm", dy, x, w)
        if kernel is None:  # the compiled path went away between passes (MEGATRON_LIKE_NO_CSRC set)
            with torch.enable_grad():
                leaves = x.detach().requires_grad_(), w.detach().requires_grad_()
                dx, dw = torch.autograd.grad(grouped_gemm_reference(*leaves, counts), leaves, dy)
            return dx, dw, None, None, None
        module, last_arg = kernel
        dy = dy.contiguous()
        experts, k, n = w.shape
        code = dtype_code(x.dtype)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = torch.empty_like(x)
            module.run(GRAD_INPUT, dy.data_ptr(), w.data_ptr(), dx.data_ptr(), counts.data_ptr(), experts, k, n, code,
                       last_arg)
        if ctx.needs_input_grad[1]:
            dw = torch.empty_like(w)
            module.run(GRAD_WEIGHT, x.data_ptr(), dy.data_ptr(), dw.data_ptr(), counts.data_ptr(), experts, k, n,
                       code, last_arg)
        return dx, dw, None, None, None


def grouped_gemm(x: torch.Tensor, w: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """Return ``[T, n]``: rows of ``x [T, k]`` grouped by expert (in expert order) times ``w[e] [k, n]``.

    ``tokens_per_expert`` is a CPU int64 ``[E]`` summing to ``T``; empty groups and ``T == 0`` are allowed
    (an expert without tokens gets a zero weight gradient). Differentiable in ``x`` and ``w``.
    """
    check_grouped_gemm_args(x, w, tokens_per_expert)
    kernel = pick_kernel("grouped_gemm", x, w) if x.numel() and w.numel() else None
    if kernel is None:
        return grouped_gemm_reference(x, w, tokens_per_expert)
    return GroupedGemm.apply(x, w, tokens_per_expert.contiguous(), *kernel)
