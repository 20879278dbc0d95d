"""Gradient reductions that make every rank's gradients those of the single-process model.

After the backward passes of a global batch, in this order:

1. sequence-parallel parameters (LayerNorms, row-parallel biases) hold partial gradients of their
   sequence shard: all-reduce (sum) over the tensor-parallel group;
2. the word embedding of the first stage and its tied copy on the last stage: all-reduce (sum) over the
   embedding group, so both apply the same update;
3. data parallelism: average every gradient over the data-parallel group, in buckets of flat buffers.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from megatron_like import collectives as comm
from megatron_like.parallel_state import ParallelState

BUCKET_BYTES = 40 * 1024 * 1024


def _all_reduce_flat(grads: list[torch.Tensor], group: comm.Group, op: str) -> None:
    """All-reduce many gradients as flat buckets (few large messages beat many small ones)."""
    bucket: list[torch.Tensor] = []
    size = 0

    def flush() -> None:
        nonlocal bucket, size
        if not bucket:
            return
        flat = torch.cat([g.reshape(-1) for g in bucket])
        comm.all_reduce(flat, group, op=op)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        bucket, size = [], 0

    for grad in grads:
        bucket.append(grad)
        size += grad.numel() * grad.element_size()
        if size >= BUCKET_BYTES:
            flush()
    flush()


def params_with_grad(model: Iterable[nn.Module]) -> list[nn.Parameter]:
    return [p for chunk in model for p in chunk.parameters() if p.grad is not None]


def embedding_weights(model: Iterable[nn.Module]) -> list[nn.Parameter]:
    """The tied word-embedding weights this rank holds in its first/last pipeline chunk."""
    weights = []
    for chunk in model:
        weight = chunk.shared_embedding_weight() if hasattr(chunk, "shared_embedding_weight") else None
        if weight is not None and weight.grad is not None:
            weights.append(weight)
    return weights


def finish_grad_sync(model: list[nn.Module], ps: ParallelState) -> None:
    """Reduce the gradients of all model chunks of this rank (see module docstring for the order)."""
    params = params_with_grad(model)
    sequence_parallel = [p.grad for p in params if getattr(p, "sequence_parallel", False)]
    if sequence_parallel and ps.tp_group is not None:
        _all_reduce_flat(sequence_parallel, ps.tp_group, op="sum")
    if ps.embedding_group is not None:
        _all_reduce_flat([w.grad for w in embedding_weights(model)], ps.embedding_group, op="sum")
    if ps.dp_group is not None:
        _all_reduce_flat([p.grad for p in params], ps.dp_group, op="avg")
