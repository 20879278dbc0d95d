"""The router's auxiliary losses: added to the gradient by an autograd hook, and logged as their own lines.

Megatron-LM's way: the loss is not added to the language-model loss (which lives on the last pipeline stage
only, while routers live on every stage). Instead :func:`attach_aux_loss` returns its input unchanged and,
in backward, gives the loss the gradient it would get had it been added to the micro batch's loss: the
scale every micro batch's loss is multiplied by (``loss_scale / num_microbatches``, set per step by
:func:`set_aux_loss_backward_scale`). The value (before its coefficient) is recorded per layer for the log
(:func:`record_aux_loss`) and reduced once per step (:func:`reduce_aux_losses`).
"""

from __future__ import annotations

import torch

from megatron_like import collectives as comm
from megatron_like.parallel_state import ParallelState


class _BackwardScale:
    value = 1.0


def set_aux_loss_backward_scale(scale: float) -> None:
    """The factor d(step loss) / d(micro-batch aux loss): fp16 loss scale / number of micro batches."""
    _BackwardScale.value = scale


class _AttachAuxLoss(torch.autograd.Function):
    """Forward: identity on ``x``. Backward: ``x``'s gradient passes, ``aux_loss`` gets the backward scale."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.full_like(aux_loss, _BackwardScale.value)


def attach_aux_loss(x: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
    """``x`` unchanged; backward through it also backpropagates ``aux_loss`` (a scalar, coefficient included)."""
    return _AttachAuxLoss.apply(x, aux_loss)


# ---------------------------------------------------------------- logging
_tracked: dict[str, dict[int, torch.Tensor]] = {}
"""name -> {global layer index: sum over this step's micro batches of the loss (no coefficient)}."""


def record_aux_loss(name: str, layer: int, value: torch.Tensor) -> None:
    """Add one micro batch's ``value`` of loss ``name`` in MoE layer ``layer`` to this step's record."""
    per_layer = _tracked.setdefault(name, {})
    per_layer[layer] = per_layer.get(layer, 0.0) + value.detach().float()


def reset_aux_losses() -> None:
    """Forget what was recorded (start of a step)."""
    _tracked.clear()


def reduce_aux_losses(names: list[str], moe_layers: list[int], num_microbatches: int,
                      ps: ParallelState) -> dict[str, float]:
    """Each of ``names``: the mean over MoE layers, micro batches and data-parallel ranks (Megatron's log value).

    Collective over the pipeline (stages hold different layers: summed) and data-parallel x context-parallel groups
    (averaged: a cp rank's loss is its share of the whole sequence's, see ``router.py``); tensor-parallel ranks
    computed the same values. Every rank must call it with the same ``names``.
    """
    if not names:
        return {}
    index = {layer: i for i, layer in enumerate(moe_layers)}
    table = torch.zeros(len(names), len(moe_layers), dtype=torch.float32, device=ps.device)
    for row, name in enumerate(names):
        for layer, value in _tracked.get(name, {}).items():
            table[row, index[layer]] = value
    comm.all_reduce(table, ps.pp_group)
    comm.all_reduce(table, ps.dp_cp_group, op="avg")
    means = table.sum(dim=1) / (num_microbatches * len(moe_layers))
    reset_aux_losses()
    return dict(zip(names, means.tolist()))
