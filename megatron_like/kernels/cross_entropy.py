"""Fused vocabulary cross entropy: per-row loss without materializing the softmax.

``fused_vocab_cross_entropy(logits, targets)`` returns ``logsumexp(logits) - logits[target]`` per
row. The forward keeps only the row max and log-sum ``[n]``; the backward writes
``grad_loss * (softmax - one_hot)`` in one pass over the logits. PyTorch's
``F.cross_entropy(reduction="none")`` instead writes a ``[n, v]`` log-softmax in the forward and
reads and writes ``[n, v]`` twice in the backward. The loss is float32 for 32/16-bit logits (float64
for float64): a bf16 loss would round away the differences training looks at.

This is the single-device op; the tensor-parallel vocab-split cross entropy lives in
``megatron_like.tensor_parallel.cross_entropy``.
"""

from __future__ import annotations

import torch

from megatron_like.kernels._common import accum_dtype, device_type_of, dtype_code, pick_kernel


def _check_targets(targets: torch.Tensor, vocab: int, ignore_index: int) -> None:
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= vocab))
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise IndexError(f"target {int(targets[row])} at row {row} is out of range for a vocabulary of {vocab}")


def _cross_entropy_forward_torch(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (loss, row_max, log_sum), each ``[n]``, for ``logits`` ``[n, v]`` (the fallback)."""
    _check_targets(targets, logits.shape[-1], ignore_index)
    x = logits.to(accum_dtype(logits.dtype))
    row_max = x.amax(dim=-1)
    log_sum = torch.exp(x - row_max.unsqueeze(1)).sum(dim=-1).log()
    keep = targets != ignore_index
    picked = x.gather(1, torch.where(keep, targets, 0).unsqueeze(1)).squeeze(1)
    return torch.where(keep, (row_max - picked) + log_sum, 0.0), row_max, log_sum


def _cross_entropy_backward_torch(
    logits: torch.Tensor,
    targets: torch.Tensor,
    row_max: torch.Tensor,
    log_sum: torch.Tensor,
    grad_loss: torch.Tensor,
    ignore_index: int,
) -> torch.Tensor:
    """Return ``grad_loss * (softmax - one_hot)`` ``[n, v]`` (the fallback)."""
    keep = targets != ignore_index
    g = torch.where(keep, grad_loss.to(log_sum.dtype), 0.0)
    shifted = logits.to(log_sum.dtype) - row_max.unsqueeze(1)
    grad = torch.exp(shifted - log_sum.unsqueeze(1)) * g.unsqueeze(1)
    grad.scatter_add_(1, torch.where(keep, targets, 0).unsqueeze(1), -g.unsqueeze(1))
    return grad.to(logits.dtype)


class FusedVocabCrossEntropy(torch.autograd.Function):
    """loss[n] = logsumexp(logits[n, v]) - logits[n, target[n]]; 0 where target == ignore_index."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                inplace_backward: bool = False) -> torch.Tensor:
        n, v = logits.shape
        targets = targets.to(torch.int64).contiguous()
        # The CPU kernel checks the targets itself; a CUDA kernel cannot raise, so CUDA tensors are checked here
        # first (one host synchronization), as the fallback does.
        kernel = pick_kernel("vocab_cross_entropy", logits) if targets.device == logits.device else None
        if kernel is None:
            loss, row_max, log_sum = _cross_entropy_forward_torch(logits, targets, ignore_index)
        else:
            module, last_arg = kernel
            if device_type_of(logits) == "cuda":
                _check_targets(targets, v, ignore_index)
            logits = logits.contiguous()
            loss = torch.empty(n, dtype=accum_dtype(logits.dtype), device=logits.device)
            row_max = torch.empty_like(loss)
            log_sum = torch.empty_like(loss)
            module.forward(logits.data_ptr(), targets.data_ptr(), loss.data_ptr(), row_max.data_ptr(),
                           log_sum.data_ptr(), n, v, ignore_index, dtype_code(logits.dtype), last_arg)
        ctx.save_for_backward(logits, targets, row_max, log_sum)
        ctx.ignore_index, ctx.inplace_backward = ignore_index, inplace_backward
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        logits, targets, row_max, log_sum = ctx.saved_tensors
        kernel = pick_kernel("vocab_cross_entropy", logits) if grad_loss.device == logits.device else None
        if kernel is None:
            grad = _cross_entropy_backward_torch(logits, targets, row_max, log_sum, grad_loss, ctx.ignore_index)
            return grad, None, None, None
        module, last_arg = kernel
        n, v = logits.shape
        grad_loss = grad_loss.to(log_sum.dtype).contiguous()
        # The kernel reads each logit once, just before writing its gradient, so it may write over the
        # logits: no fresh [n, v] buffer (for a 50k vocabulary, hundreds of MB and their page faults).
        grad = logits if ctx.inplace_backward else torch.empty_like(logits)
        module.backward(logits.data_ptr(), targets.data_ptr(), row_max.data_ptr(), log_sum.data_ptr(),
                        grad_loss.data_ptr(), grad.data_ptr(), n, v, ctx.ignore_index, dtype_code(logits.dtype),
                        last_arg)
        return grad, None, None, None


def fused_vocab_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                              inplace_backward: bool = False) -> torch.Tensor:
    """Return the per-token cross entropy of ``logits`` against ``targets``.

    Args:
        logits: ``[..., v]`` unnormalized scores (float32, bfloat16, float16 or float64).
        targets: integer class ids shaped like ``logits.shape[:-1]``.
        ignore_index: target value whose loss and gradient are 0 (as in ``F.cross_entropy``).
        inplace_backward: write the gradient over ``logits`` (saves a ``[n, v]`` buffer); only when
            nothing else reads the logits after this loss's backward.

    Returns:
        loss shaped like ``targets``: float32 (float64 for float64 logits).
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"fused_vocab_cross_entropy: targets {tuple(targets.shape)} do not match logits {tuple(logits.shape)}"
        )
    vocab = logits.shape[-1]
    loss = FusedVocabCrossEntropy.apply(logits.reshape(-1, vocab), targets.reshape(-1), ignore_index, inplace_backward)
    return loss.view(targets.shape)
