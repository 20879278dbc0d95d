"""Data-parallel gradient buffers and bucketed reduction, ZeRO sharding, memory accounting."""

from megatron_like.distributed.buffers import Bucket, ParamAndGradBuffer
from megatron_like.distributed.data_parallel import DataParallel, gathered_parameters

__all__ = ["Bucket", "DataParallel", "ParamAndGradBuffer", "gathered_parameters"]
