"""ZB-H1's step orders, checked without processes: each micro batch's F, B and W once, W after its B; 1F1B's
forward/backward order and activation bound kept; the paper's bubble by simulation; the communication plan
free of deadlocks under NCCL's in-order rule (tags collapsed too); the one-line errors."""

from __future__ import annotations

import pytest

from megatron_like.config import ConfigError, parse_config
from megatron_like.pipeline_parallel import (
    Step,
    forward_backward_pipelining_zero_bubble,
    get_forward_backward_func,
    one_f_one_b_steps,
    zb_h1_steps,
)
from megatron_like.pipeline_parallel.trace import (
    idle_fractions,
    max_awaiting_weights,
    max_in_flight,
    simulate,
    theoretical_bubble,
)
from megatron_like.pipeline_parallel.zero_bubble import check_weight_steps, zb_h1_bubble
from tests.distributed.test_pipeline_schedules import (
    assert_plan_needs_no_tags,
    assert_plan_runs_in_order,
    assert_streams_consumed_in_order,
    orders,
    sent_after,
)

LAYOUTS = [(pp, m) for pp in (2, 3, 4, 8) for m in (1, 2, 3, 4, 7, 8, 16)]
STEP_TIMES = [(1.0, 1.0, 1.0), (1.0, 1.2, 0.8), (1.0, 2.0, 1.0)]  # (F, B, W): equal, as measured, W = B / 2


@pytest.mark.parametrize("pp,m", LAYOUTS)
def test_zb_h1_runs_f_b_w_once_and_keeps_1f1b_order_and_activation_bound(pp, m):
    for rank, steps in enumerate(orders(pp, 1, m, schedule="zb-h1")):
        assert sorted(steps) == sorted(Step(k, 0, i) for k in "FBW" for i in range(m))
        check_weight_steps(steps)
        assert [s for s in steps if s.kind != "W"] == one_f_one_b_steps(pp, rank, m)
        assert [s.microbatch for s in steps if s.kind == "W"] == list(range(m))  # grads accumulate in order
        assert max_in_flight(steps) == min(pp - rank, m)  # whole activations: 1F1B's bound on every rank
        assert max_awaiting_weights(steps) == min(pp, m)  # GEMM inputs kept for W: rank 0's 1F1B count
    assert all(s.kind == "F" for steps in orders(pp, 1, m, True, "zb-h1") for s in steps)


@pytest.mark.parametrize("pp,m", LAYOUTS)
def test_zb_h1_simulated_bubble_is_the_papers(pp, m):
    """Each rank idles (p - 1)(F + B - W) once m >= p (1F1B: (p - 1)(F + B + W)), also with results sent as the
    communication plan batches them; fewer micro batches than stages still beat 1F1B."""
    for forward_time, backward_time, weight_time in STEP_TIMES:
        for plan in (None, sent_after(pp, 1, m, schedule="zb-h1")):
            events = simulate(orders(pp, 1, m, schedule="zb-h1"), 1, forward_time, backward_time, plan, weight_time)
            one_f_one_b = theoretical_bubble(pp, 1, m)
            if m >= pp:
                expected = zb_h1_bubble(pp, m, forward_time, backward_time, weight_time)
                assert idle_fractions(events) == pytest.approx([expected] * pp, abs=1e-9)
                assert expected < one_f_one_b
            else:
                assert max(idle_fractions(events)) <= one_f_one_b + 1e-9


@pytest.mark.parametrize("pp,m", LAYOUTS)
def test_zb_h1_plan_runs_on_in_order_streams_without_tags(pp, m):
    assert_plan_runs_in_order(pp, 1, m, "zb-h1")
    assert_plan_needs_no_tags(pp, 1, m, "zb-h1")
    assert_streams_consumed_in_order(pp, 1, m, "zb-h1")


def test_weight_step_errors():
    good = zb_h1_steps(2, 0, 2)
    check_weight_steps(good)
    with pytest.raises(ValueError, match="W of micro batch 0 .* runs twice"):
        check_weight_steps(good + [Step("W", 0, 0)])
    with pytest.raises(ValueError, match="W of micro batch 1 .* never runs"):
        check_weight_steps([s for s in good if s != Step("W", 0, 1)])
    early = [Step("F", 0, 0), Step("W", 0, 0), Step("B", 0, 0)]
    with pytest.raises(ValueError, match="W of micro batch 0 .* runs before its B"):
        check_weight_steps(early)


def test_schedule_flag_and_its_one_line_errors():
    assert get_forward_backward_func(2, 1, "zb-h1") is forward_backward_pipelining_zero_bubble
    flags = ["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--micro-batch-size", "1", "--mock-data",
             "--vocab-size", "256", "--global-batch-size", "4"]
    assert parse_config(flags + ["--pipeline-schedule", "zb-h1"], world_size=2).parallel.pipeline_schedule == "zb-h1"
    for extra, message in [
        (["--num-layers-per-virtual-pipeline-stage", "1"], "--pipeline-schedule zb-h1 runs one model chunk per rank"),
        (["--pipeline-model-parallel-size", "1"], "--pipeline-schedule zb-h1 needs --pipeline-model-parallel-size > 1"),
    ]:
        with pytest.raises(ConfigError, match=message) as error:
            parse_config(flags + ["--pipeline-schedule", "zb-h1"] + extra, world_size=2)
        assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="interleaved needs --num-layers-per-virtual-pipeline-stage"):
        parse_config(flags + ["--pipeline-schedule", "interleaved"], world_size=2)
