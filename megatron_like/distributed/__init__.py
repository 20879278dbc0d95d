"""Data-parallel gradient reduction (and, with ZeRO, sharding of optimizer state, grads and params)."""

from megatron_like.distributed.grad_sync import finish_grad_sync

__all__ = ["finish_grad_sync"]
