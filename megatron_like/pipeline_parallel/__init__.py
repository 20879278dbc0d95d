"""Pipeline parallelism: point-to-point communication and schedules."""

from megatron_like.pipeline_parallel.schedules import (
    forward_backward_no_pipelining,
    get_forward_backward_func,
)

__all__ = ["forward_backward_no_pipelining", "get_forward_backward_func"]
