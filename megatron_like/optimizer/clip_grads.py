"""Global gradient norm over the whole model-parallel world, each parameter counted once."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from megatron_like import collectives as comm
from megatron_like.parallel_state import ParallelState


def counts_toward_norm(param: nn.Parameter, ps: ParallelState) -> bool:
    """A replicated parameter is counted on tp rank 0 only; the last stage's tied embedding copy never."""
    if getattr(param, "shared_embedding", False):
        return False
    return getattr(param, "tensor_model_parallel", False) or ps.tp_rank == 0


def global_grad_norm(params: Iterable[nn.Parameter], ps: ParallelState) -> float:
    """L2 norm of all gradients of the model replica (tp x pp ranks), as the single-process model's."""
    grads = [p.grad for p in params if p.grad is not None and counts_toward_norm(p, ps)]
    device = ps.device
    if grads:
        squares = torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]).square().sum()
    else:
        squares = torch.zeros((), device=device)
    squares = squares.reshape(1).to(device=device, dtype=torch.float32)
    comm.all_reduce(squares, ps.model_parallel_group)
    return float(squares.sqrt())


def clip_grads(params: Iterable[nn.Parameter], max_norm: float, total_norm: float) -> None:
    """Scale gradients in place so their global norm is at most ``max_norm`` (0 disables)."""
    if max_norm <= 0:
        return
    coefficient = max_norm / (total_norm + 1e-6)
    if coefficient < 1.0:
        grads = [p.grad for p in params if p.grad is not None]
        torch._foreach_mul_(grads, coefficient)
