"""Adam/AdamW for CPU offload: one fused pass over fp32 master params, grads and moments.

``adam_step_`` updates ``param``, ``exp_avg`` and ``exp_avg_sq`` in place from ``grad`` and, when
``param_copy`` (bf16 or fp16) is given, writes the updated params into it in the same pass: the
offloaded optimizer step of ``--optimizer-cpu-offload`` reads and writes each byte once instead of
an AdamW step plus a separate cast. The arithmetic is ``torch.optim.AdamW``'s (and ``torch.optim.Adam``'s
L2 form with ``adamw=False``): lerp for the first moment, bias corrections computed in double,
``denom = sqrt(v) / sqrt(bc2) + eps``.

``CPUAdam`` wraps it as a ``torch.optim.Optimizer`` whose state (``step``, ``exp_avg``,
``exp_avg_sq``) has the same keys and types as ``torch.optim.AdamW``'s, so checkpoints move between them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from megatron_like.kernels._common import dtype_code, threads
from megatron_like.kernels._loader import load


def _fused_ok(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors)


def _adam_step_torch(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw: bool,
    bias_correction: bool,
) -> None:
    """Apply one Adam(W) update with PyTorch ops, as torch.optim.AdamW's single-tensor path (the fallback)."""
    grad = grad.to(param.dtype)
    if adamw:
        param.mul_(1 - lr * weight_decay)
    elif weight_decay != 0:
        grad = grad.add(param, alpha=weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step if bias_correction else 1.0
    bias_correction2 = 1 - beta2**step if bias_correction else 1.0
    denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)


def adam_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    adamw: bool = True,
    bias_correction: bool = True,
    param_copy: torch.Tensor | None = None,
) -> None:
    """Apply update number ``step`` (1-based) of Adam(W) in place; returns None.

    Args:
        param, exp_avg, exp_avg_sq: fp32 tensors of one shape (e.g. a flat ZeRO shard), updated in place.
        grad: gradient of the same shape (fp32 for the fused path; other dtypes are cast first).
        step: how many updates this one makes, counting itself (bias correction uses it).
        lr, beta1, beta2, eps, weight_decay: as in ``torch.optim.AdamW``.
        adamw: decoupled weight decay (AdamW); False gives Adam's L2 form (decay added to the grad).
        bias_correction: apply Adam's bias corrections (torch always does).
        param_copy: optional bf16/fp16 tensor with param's number of elements that receives the new
            params (the model's low-precision weights).
    """
    if grad.dtype != torch.float32 and param.dtype == torch.float32:
        grad = grad.float()
    module = load("cpu_adam")
    copy_ok = param_copy is None or (
        param_copy.device.type == "cpu"
        and param_copy.dtype in (torch.bfloat16, torch.float16)
        and param_copy.is_contiguous()
        and param_copy.numel() == param.numel()
    )
    same_size = grad.numel() == exp_avg.numel() == exp_avg_sq.numel() == param.numel()
    if module is not None and copy_ok and same_size and _fused_ok(param, grad, exp_avg, exp_avg_sq):
        module.step(
            param.data_ptr(),
            grad.data_ptr(),
            exp_avg.data_ptr(),
            exp_avg_sq.data_ptr(),
            param.numel(),
            float(lr),
            float(beta1),
            float(beta2),
            float(eps),
            float(weight_decay),
            float(step),
            adamw,
            bias_correction,
            0 if param_copy is None else param_copy.data_ptr(),
            0 if param_copy is None else dtype_code(param_copy.dtype),
            threads(),
        )
        return
    _adam_step_torch(
        param, grad, exp_avg, exp_avg_sq, step, float(lr), beta1, beta2, eps, weight_decay, adamw, bias_correction
    )
    if param_copy is not None:
        param_copy.view(param.shape).copy_(param)


class CPUAdam(torch.optim.Optimizer):
    """Adam/AdamW stepping host-resident params with the fused C++ kernel (PyTorch fallback otherwise).

    ``amsgrad``, ``maximize`` and sparse gradients are not supported. ``step(param_copies=...)`` takes
    a mapping from a param to a bf16/fp16 tensor that receives its updated values in the same pass.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        adamw_mode: bool = True,
        bias_correction: bool = True,
    ) -> None:
        if lr < 0.0:
            raise ValueError(f"CPUAdam: invalid learning rate {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"CPUAdam: betas {betas} must be in [0, 1)")
        if eps < 0.0 or weight_decay < 0.0:
            raise ValueError(f"CPUAdam: eps {eps} and weight_decay {weight_decay} must be >= 0")
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            adamw_mode=adamw_mode,
            bias_correction=bias_correction,
        )
        super().__init__(params, defaults)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A state dict saved by torch.optim.AdamW lacks our group keys: fill in the defaults.
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("adamw_mode", True)
            group.setdefault("bias_correction", True)

    @torch.no_grad()
    def step(
        self,
        closure: Callable[[], float] | None = None,
        param_copies: Mapping[torch.Tensor, torch.Tensor] | None = None,
    ) -> float | None:
        """Update every param that has a gradient; return the closure's loss if one was given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError("CPUAdam does not support sparse gradients")
                state = self.state[param]
                if len(state) == 0:
                    # Same state layout as torch.optim.AdamW (float32 scalar tensor step).
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["step"] += 1
                adam_step_(
                    param,
                    param.grad,
                    state["exp_avg"],
                    state["exp_avg_sq"],
                    step=int(state["step"].item()),
                    lr=float(group["lr"]),
                    beta1=beta1,
                    beta2=beta2,
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    adamw=group["adamw_mode"],
                    bias_correction=group["bias_correction"],
                    param_copy=None if param_copies is None else param_copies.get(param),
                )
        return loss
