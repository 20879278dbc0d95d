"""Cross entropy over vocabulary-parallel logits that never gathers the full vocabulary.

Each rank holds ``v / tp`` columns of the logits. Three all-reduces of ``[s, b]``-sized tensors (max,
target logit, sum of exponentials) give the exact loss; the backward is ``softmax - one_hot`` computed
locally on the shard.
"""

from __future__ import annotations

import torch

from megatron_like import collectives as comm
from megatron_like.collectives import Group


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group: Group) -> torch.Tensor:
        logits = logits.float()
        # Subtract the global max for a stable exp; it cancels out of the loss.
        logits_max = comm.all_reduce(logits.max(dim=-1).values, group, op="max")
        logits = logits - logits_max.unsqueeze(-1)

        per_rank = logits.shape[-1]
        vocab_start = comm.group_rank(group) * per_rank
        outside = (target < vocab_start) | (target >= vocab_start + per_rank)
        local_target = (target - vocab_start).masked_fill(outside, 0)
        target_logit = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        target_logit = comm.all_reduce(target_logit, group)

        exp_logits = logits.exp_()
        sum_exp = comm.all_reduce(exp_logits.sum(dim=-1), group)
        loss = sum_exp.log() - target_logit
        # The softmax is exp_logits / sum_exp; dividing in backward, together with the grad_loss
        # scaling, saves one pass over the [tokens, v / tp] buffer.
        ctx.save_for_backward(exp_logits, sum_exp, outside, local_target)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        exp_logits, sum_exp, outside, local_target = ctx.saved_tensors
        # d loss / d logits = softmax - one_hot(target), scaled by grad_loss; reuses the saved buffer.
        grad = exp_logits.mul_((grad_loss / sum_exp).unsqueeze(-1))
        grad.scatter_add_(-1, local_target.unsqueeze(-1), ((outside.float() - 1.0) * grad_loss).unsqueeze(-1))
        return grad, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp_group: Group) -> torch.Tensor:
    """Per-token loss ``[...]`` (float32) from logits ``[..., v / tp]`` and target ids ``[...]``."""
    return _VocabParallelCrossEntropy.apply(logits, target, tp_group)
