"""Forward/backward schedules over the micro batches of one global batch.

Every schedule has the same signature and returns the loss statistics of the micro batches it
computed the loss for (only the last pipeline stage has any):

    schedule(forward_step_func, data_iterator, model, num_microbatches, forward_only=False)
        -> list[dict[str, torch.Tensor]]

``forward_step_func(data_iterator, model_chunk) -> (output, loss_func)`` is the Megatron contract:
``loss_func(output) -> (loss, stats)`` with ``loss`` a scalar to backpropagate (averaged over this
micro batch's tokens) and ``stats`` detached scalars for logging.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

LossStats = dict[str, torch.Tensor]
ForwardStepFunc = Callable[[Iterator | None, nn.Module], tuple[torch.Tensor, Callable]]


def forward_backward_no_pipelining(
    forward_step_func: ForwardStepFunc,
    data_iterator: Iterator[Any] | None,
    model: list[nn.Module],
    num_microbatches: int,
    forward_only: bool = False,
) -> list[LossStats]:
    """Gradient accumulation on one stage: forward and backward each micro batch in turn.

    The loss of each micro batch is divided by ``num_microbatches`` so the accumulated gradient is the
    gradient of the mean loss over the global batch (the data-parallel all-reduce then averages ranks).
    """
    if len(model) != 1:
        raise ValueError("no-pipelining schedule runs exactly one model chunk")
    chunk = model[0]
    stats: list[LossStats] = []
    for _ in range(num_microbatches):
        output, loss_func = forward_step_func(data_iterator, chunk)
        loss, micro_stats = loss_func(output)
        stats.append(micro_stats)
        if not forward_only:
            (loss / num_microbatches).backward()
    return stats


def get_forward_backward_func(pp_size: int, vp_size: int = 1) -> Callable[..., list[LossStats]]:
    """The schedule for this layout (pipelined schedules are added with pipeline parallelism)."""
    if pp_size == 1:
        return forward_backward_no_pipelining
    raise NotImplementedError("pipeline parallelism is not implemented yet (--pipeline-model-parallel-size 1)")
