"""The column-parallel linear of sequence parallelism, keeping only this rank's sequence shard for backward.

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
(``distributed/buffers.py``'s hooks) is unchanged. Inside a zero-bubble run with the weight gradient deferred the
layer does not use this op (``layers.py``): W keeps the gathered input it needs (``weight_grad.py``).
"""

from __future__ import annotations

import torch

from megatron_like import collectives as comm
from megatron_like.collectives import Group
from megatron_like.tensor_parallel import cpu_gemm


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


def sequence_parallel_column_linear(shard: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                    tp_group: Group, backend: str) -> torch.Tensor:
    """``shard [s / tp, b, in]``, ``weight [out / tp, in]``, ``bias [out / tp]`` -> ``[s, b, out / tp]`` over the
    all-gathered sequence, keeping only ``shard`` for backward (module docstring); ``backend`` from
    ``cpu_gemm.resolve_backend``. A group of one is a plain linear."""
    if tp_group is None:
        return cpu_gemm.linear(shard, weight, bias, backend)
    return _SequenceParallelColumnLinear.apply(shard, weight, bias, tp_group, backend)
