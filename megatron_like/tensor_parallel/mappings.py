"""Autograd-aware collectives of tensor parallelism (Megatron's mappings).

Each function is one tiny ``autograd.Function`` whose backward is the mirror image of its forward.
Activations are ``[s, b, h]``; "tp region" functions act on the last (hidden) dim, "sequence parallel"
functions on the first (sequence) dim. ``group`` is the tensor-parallel group (None = one rank).
"""

from __future__ import annotations

import torch

from megatron_like import collectives as comm
from megatron_like.collectives import Group


class _CopyToTensorParallelRegion(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce (every rank's partial input gradient is summed)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return comm.all_reduce(grad.contiguous().clone(), ctx.group), None


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    """Forward: all-reduce (sum the partial outputs). Backward: identity."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        return comm.all_reduce(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _ScatterToTensorParallelRegion(torch.autograd.Function):
    """Forward: keep this rank's chunk of the last dim. Backward: all-gather the last dim."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return comm.split_along_dim(x, group, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return comm.all_gather_along_dim(grad, ctx.group, dim=-1), None


class _GatherFromTensorParallelRegion(torch.autograd.Function):
    """Forward: all-gather the last dim. Backward: keep this rank's chunk."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return comm.all_gather_along_dim(x, group, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return comm.split_along_dim(grad, ctx.group, dim=-1), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    """Forward: keep this rank's chunk of the sequence dim. Backward: all-gather the sequence dim."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return comm.split_along_dim(x, group, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return comm.all_gather_along_dim(grad, ctx.group, dim=0), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """Forward: all-gather the sequence dim.

    Backward: reduce-scatter when the consumer is a tensor-parallel matmul (each rank holds a partial
    gradient of the full sequence), else just keep this rank's chunk.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, grad_is_partial: bool) -> torch.Tensor:
        ctx.group, ctx.grad_is_partial = group, grad_is_partial
        return comm.all_gather_along_dim(x, group, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.grad_is_partial:
            return comm.reduce_scatter_along_dim(grad, ctx.group, dim=0), None, None
        return comm.split_along_dim(grad, ctx.group, dim=0), None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Forward: sum partial outputs and keep this rank's sequence chunk. Backward: all-gather."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return comm.reduce_scatter_along_dim(x, group, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return comm.all_gather_along_dim(grad, ctx.group, dim=0), None


def copy_to_tensor_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group is None else _CopyToTensorParallelRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group is None else _ReduceFromTensorParallelRegion.apply(x, group)


def scatter_to_tensor_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group is None else _ScatterToTensorParallelRegion.apply(x, group)


def gather_from_tensor_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group is None else _GatherFromTensorParallelRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group is None else _ScatterToSequenceParallelRegion.apply(x, group)


def gather_from_sequence_parallel_region(
    x: torch.Tensor, group: Group, grad_is_partial: bool = True
) -> torch.Tensor:
    return x if group is None else _GatherFromSequenceParallelRegion.apply(x, group, grad_is_partial)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group is None else _ReduceScatterToSequenceParallelRegion.apply(x, group)
