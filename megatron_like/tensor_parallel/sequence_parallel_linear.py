"""The linears of sequence parallelism, keeping only this rank's sequence shard for backward (and for W).

Under sequence parallelism a column-parallel linear reads the whole sequence: its input ``[s / tp, b, in]`` is
all-gathered to ``[s, b, in]`` first. Its weight gradient ``dW = dy^T x`` needs that whole input again in
backward. Keeping the gathered tensor from forward to backward would cost ``tp`` times the shard, on every
column-parallel linear of every layer (QKV, MLP fc1, MLA's up-projections, the output layer), undoing what
sequence parallelism saves. So, as Megatron-LM's ``LinearWithGradAccumulationAndAsyncCommunication``, this op
keeps the shard only and gathers it again in backward:

* forward: all-gather ``x [s / tp, b, in]`` -> ``[s, b, in]``, ``y = x W^T + b`` -> ``[s, b, out / tp]``; the
  gathered input is freed when forward returns;
* backward: start the all-gather of the kept shard (asynchronous), compute the input gradient
  ``dy W [s, b, in]`` while it runs, wait; start the reduce-scatter of the input gradient (each rank holds a
  partial sum over its output features: the shard's gradient is the sum over ranks) and compute ``dW`` and
  ``db`` from the re-gathered input while it runs; wait.

The GEMMs are those of ``cpu_gemm`` (MKL or oneDNN on fp32 CPU, ``F.linear``'s kernels otherwise). The weight
gradient is returned to autograd like any other, so gradient accumulation into the data-parallel buffer
(``distributed/buffers.py``'s hooks) is unchanged.

Inside a zero-bubble run (``weight_grad.split_backward``) the weight gradient waits for the W step, and the same
choice arises for the time between B and W. By default these ops keep the shards there too:

* column-parallel (:func:`sequence_parallel_column_linear`): B computes ``dy W`` and reduce-scatters it to
  the shard (it needs the weight and ``dy``, not ``x``); W all-gathers the kept shard ``[s / tp, b, in]`` again
  and computes ``dW = dy^T x``;
* row-parallel (:func:`sequence_parallel_row_linear`, forward ``x W^T`` reduce-scattered to ``[s / tp, b,
  out]``): B all-gathers the output gradient's shard to ``[s, b, out]`` for ``dx = dy W``; W keeps the shard and
  all-gathers it again for ``dW = dy^T x``.

So a W stash holds what 1F1B's backward would have held for a moment, split by tp, at the price of one more
all-gather of ``[s, b, .]`` per linear and micro batch, run in W where no other stage waits for it.
``--keep-gathered-sequence-for-wgrad`` (``weight_grad.keeps_gathered()``) keeps the gathered tensors instead (the
plain mappings around ``weight_grad.linear``): no extra all-gather, ``tp`` times those tensors' memory from B (the
column's: from F) until W.
"""

from __future__ import annotations

import torch

from megatron_like import collectives as comm
from megatron_like.collectives import Group
from megatron_like.tensor_parallel import cpu_gemm, weight_grad
from megatron_like.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)


def _start_all_gather(shard: torch.Tensor, tp_group: Group) -> tuple[torch.Tensor, object]:
    """``shard [s / tp, ...]`` -> ``([s, ...], work)``: the gathered tensor, valid once ``work.wait()`` returned."""
    shard = shard.contiguous()
    gathered = shard.new_empty((comm.group_size(tp_group) * shard.shape[0],) + tuple(shard.shape[1:]))
    return gathered, comm.all_gather_flat(gathered.view(-1), shard.view(-1), tp_group, async_op=True)


class _SequenceParallelColumnLinear(torch.autograd.Function):
    """Forward: all-gather the sequence, then ``x W^T + b``. Backward: re-gather, input gradient reduce-scattered."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tp_group: Group,
                backend: str) -> torch.Tensor:
        ctx.save_for_backward(shard, weight)
        ctx.tp_group, ctx.backend, ctx.has_bias = tp_group, backend, bias is not None
        gathered = comm.all_gather_along_dim(shard, tp_group, dim=0)
        return cpu_gemm.linear(gathered, weight, bias, backend)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shard, weight = ctx.saved_tensors
        tp_group, wants_weight_grad = ctx.tp_group, ctx.needs_input_grad[1]
        if wants_weight_grad:  # the re-gather overlaps the input-gradient GEMM
            gathered, gathering = _start_all_gather(shard, tp_group)
        grad_shard = reducing = None
        if ctx.needs_input_grad[0]:
            grad_input = cpu_gemm.linear(grad, weight.t(), None, ctx.backend).contiguous()  # [s, b, in], partial
            grad_shard = grad_input.new_empty(shard.shape)
            # the reduce-scatter overlaps the weight-gradient GEMM
            reducing = comm.reduce_scatter_flat(grad_shard.view(-1), grad_input.view(-1), tp_group, async_op=True)
        grad2d = grad.reshape(-1, grad.shape[-1])  # [s b, out / tp]
        grad_weight = None
        if wants_weight_grad:
            gathering.wait()
            grad_weight = grad2d.t().mm(gathered.view(-1, gathered.shape[-1]))
        grad_bias = grad2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        if reducing is not None:
            reducing.wait()
        return grad_shard, grad_weight, grad_bias, None, None


class _SplitColumnOp:
    """The column linear over the gathered sequence as a ``weight_grad`` split op; ``x`` is the shard ``[s / tp, b,
    in]`` (kept for W), ``extra`` (backend, tp group)."""

    @staticmethod
    def forward(shard, weight, bias, extra):
        backend, tp_group = extra
        return cpu_gemm.linear(comm.all_gather_along_dim(shard, tp_group, dim=0), weight, bias, backend)

    @staticmethod
    def input_grad(dy, weight, extra):
        backend, tp_group = extra
        partial = cpu_gemm.linear(dy, weight.t(), None, backend)  # [s, b, in], a partial sum over the tp ranks
        return comm.reduce_scatter_along_dim(partial, tp_group, dim=0)

    @staticmethod
    def weight_grad(dy, shard, extra, with_bias):
        _, tp_group = extra
        return weight_grad.linear_weight_grads(dy, comm.all_gather_along_dim(shard, tp_group, dim=0), with_bias)


class _SplitRowOp:
    """The row linear reduce-scattered to the sequence shard as a ``weight_grad`` split op (no bias: the layer adds
    it after the reduction); its output gradient, kept for W, is the shard ``[s / tp, b, out]``; ``extra`` (backend,
    tp group)."""

    @staticmethod
    def forward(x, weight, bias, extra):
        backend, tp_group = extra
        return comm.reduce_scatter_along_dim(cpu_gemm.linear(x, weight, None, backend), tp_group, dim=0)

    @staticmethod
    def input_grad(dy_shard, weight, extra):
        backend, tp_group = extra
        return cpu_gemm.linear(comm.all_gather_along_dim(dy_shard, tp_group, dim=0), weight.t(), None, backend)

    @staticmethod
    def weight_grad(dy_shard, x, extra, with_bias):
        _, tp_group = extra
        return weight_grad.linear_weight_grads(comm.all_gather_along_dim(dy_shard, tp_group, dim=0), x, False)


def sequence_parallel_column_linear(shard: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                    tp_group: Group, backend: str, defer_weight_grad: bool = True) -> torch.Tensor:
    """``shard [s / tp, b, in]``, ``weight [out / tp, in]``, ``bias [out / tp]`` -> ``[s, b, out / tp]`` over the
    all-gathered sequence, keeping only ``shard`` for backward, or in a zero-bubble run for W (unless
    ``weight_grad.keeps_gathered()``, or ``defer_weight_grad`` is False: then as ``weight_grad.linear``); module
    docstring. ``backend`` from ``cpu_gemm.resolve_backend``. A group of one is a plain linear."""
    if weight_grad.splits(weight, defer_weight_grad):
        if tp_group is None or weight_grad.keeps_gathered():
            gathered = gather_from_sequence_parallel_region(shard, tp_group, grad_is_partial=True)
            return weight_grad.linear(gathered, weight, bias, backend)
        return weight_grad.split_op(_SplitColumnOp, (backend, tp_group), shard, weight, bias)
    if tp_group is None:
        return cpu_gemm.linear(shard, weight, bias, backend)
    return _SequenceParallelColumnLinear.apply(shard, weight, bias, tp_group, backend)


def sequence_parallel_row_linear(x: torch.Tensor, weight: torch.Tensor, tp_group: Group,
                                 backend: str) -> torch.Tensor:
    """``x [s, b, in / tp]``, ``weight [out, in / tp]`` -> ``x W^T`` summed over the tp ranks and reduce-scattered
    to ``[s / tp, b, out]``. In a zero-bubble run W keeps the output gradient's shard and gathers it again (unless
    ``weight_grad.keeps_gathered()``: then it keeps the gathered ``[s, b, out]``); module docstring."""
    if weight_grad.splits(weight) and tp_group is not None and not weight_grad.keeps_gathered():
        return weight_grad.split_op(_SplitRowOp, (backend, tp_group), x, weight, None)
    return reduce_scatter_to_sequence_parallel_region(weight_grad.linear(x, weight, None, backend), tp_group)
