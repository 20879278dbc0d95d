"""Data-parallel gradient buffers and bucketed reduction, ZeRO sharding, memory accounting."""

from megatron_like.distributed.buffers import Bucket, ParamAndGradBuffer
from megatron_like.distributed.data_parallel import DataParallel, gathered_parameters
from megatron_like.distributed.grad_sync import finish_grad_sync

__all__ = ["Bucket", "DataParallel", "ParamAndGradBuffer", "finish_grad_sync", "gathered_parameters"]
