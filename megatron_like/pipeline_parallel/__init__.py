"""Pipeline parallelism: point-to-point communication (p2p.py), schedules (schedules.py) and their
trace (trace.py). ``get_forward_backward_func(pp, vp, schedule)`` picks the schedule; see docs/pipeline.md."""

from megatron_like.pipeline_parallel.comm_plan import in_order_plans
from megatron_like.pipeline_parallel.p2p import PipelineP2P, pipeline_tensor_shape
from megatron_like.pipeline_parallel.schedules import (
    check_pipeline_schedule,
    communication_plan,
    forward_backward_no_pipelining,
    forward_backward_pipelining_dualpipev,
    forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_without_interleaving,
    forward_backward_pipelining_zb_v,
    forward_backward_pipelining_zero_bubble,
    get_forward_backward_func,
    interleaved_steps,
    one_f_one_b_steps,
)
from megatron_like.pipeline_parallel.trace import ScheduleTrace, Step, record_schedule
from megatron_like.pipeline_parallel.v_schedules import dualpipev_steps, zb_v_steps
from megatron_like.pipeline_parallel.zero_bubble import zb_h1_steps

__all__ = [
    "PipelineP2P",
    "ScheduleTrace",
    "Step",
    "check_pipeline_schedule",
    "communication_plan",
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_dualpipev",
    "forward_backward_pipelining_with_interleaving",
    "forward_backward_pipelining_without_interleaving",
    "forward_backward_pipelining_zb_v",
    "forward_backward_pipelining_zero_bubble",
    "get_forward_backward_func",
    "in_order_plans",
    "interleaved_steps",
    "one_f_one_b_steps",
    "pipeline_tensor_shape",
    "record_schedule",
    "dualpipev_steps",
    "zb_h1_steps",
    "zb_v_steps",
]
