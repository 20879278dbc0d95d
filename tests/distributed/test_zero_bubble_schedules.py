"""The zero-bubble step orders (ZB-H1, ZB-V, DualPipeV), checked without processes: each micro batch's F, B and W
once, W after its B; ZB-H1 keeps 1F1B's forward/backward order and activation bound, the V schedules theirs;
each bubble by simulation against its formula; the communication plan free of deadlocks under NCCL's in-order
rule (tags collapsed too); the one-line errors."""

from __future__ import annotations

import itertools

import pytest

from megatron_like.config import ConfigError, parse_config
from megatron_like.config.parallel import V_SCHEDULES
from megatron_like.model import chunk_layers
from megatron_like.pipeline_parallel import (
    Step,
    forward_backward_pipelining_dualpipev,
    forward_backward_pipelining_zb_v,
    forward_backward_pipelining_zero_bubble,
    get_forward_backward_func,
    one_f_one_b_steps,
)
from megatron_like.pipeline_parallel.placement import ChunkPlacement
from megatron_like.pipeline_parallel.trace import (
    idle_fractions,
    max_awaiting_weights,
    max_in_flight,
    simulate,
    theoretical_bubble,
)
from megatron_like.pipeline_parallel.v_schedules import zb_v_bubble
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


@pytest.mark.parametrize("schedule", ["zb-h1", *V_SCHEDULES])
def test_weight_step_errors(schedule):
    """The executor refuses an order whose W runs twice, never, or before its B (``check_weight_steps``)."""
    good = orders(2, 2, 2, schedule=schedule)[0]
    check_weight_steps(good)
    last = [s for s in good if s.kind == "W"][-1]
    with pytest.raises(ValueError, match=f"W of micro batch {last.microbatch} .* runs twice"):
        check_weight_steps(good + [last])
    with pytest.raises(ValueError, match=f"W of micro batch {last.microbatch} .* never runs"):
        check_weight_steps([s for s in good if s != last])
    backward = good.index(Step("B", last.chunk, last.microbatch))
    early = [s for s in good if s != last]
    early.insert(backward, last)  # right before its B
    with pytest.raises(ValueError, match=f"W of micro batch {last.microbatch} .* runs before its B"):
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


def test_keep_gathered_sequence_flag_and_its_one_line_errors():
    """--keep-gathered-sequence-for-wgrad needs --sequence-parallel and a schedule with W steps (else it would do
    nothing); test_zero_bubble_training.py checks that it reaches the W steps."""
    flags = ["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--micro-batch-size", "1", "--mock-data",
             "--vocab-size", "256", "--global-batch-size", "4", "--num-attention-heads", "2",
             "--tensor-model-parallel-size", "2", "--keep-gathered-sequence-for-wgrad"]
    config = parse_config(flags + ["--sequence-parallel", "--pipeline-schedule", "zb-v"], world_size=4)
    assert config.parallel.keep_gathered_sequence_for_wgrad
    for extra, message in [(["--pipeline-schedule", "zb-h1"], "--keep-gathered-sequence-for-wgrad needs "
                                                               "--sequence-parallel"),
                           (["--sequence-parallel"], "--keep-gathered-sequence-for-wgrad applies to the deferred")]:
        with pytest.raises(ConfigError, match=message) as error:
            parse_config(flags + extra, world_size=4)
        assert "\n" not in str(error.value)


# ---------------------------------------------------------------- ZB-V and DualPipeV (two chunks per rank, a V)
V_LAYOUTS = [(pp, m) for pp in (2, 3, 4, 8) for m in (1, 2, 3, 4, 7, 8, 16)]
V_PEAK = {"zb-v": lambda pp: 2 * pp, "dualpipev": lambda pp: 2 * pp + 1}  # chunk micro batches held


@pytest.mark.parametrize("schedule", V_SCHEDULES)
@pytest.mark.parametrize("pp,m", V_LAYOUTS)
def test_v_orders_run_f_b_w_once_within_their_activation_bound(schedule, pp, m):
    """Each (chunk, micro batch) runs F, B and W once, W after its B, each chunk's micro batches in order; a rank
    holds at most 2p chunk micro batches under ZB-V (p whole stages: 1F1B's first-stage bound, on every rank)
    and 2p + 1 under DualPipeV (DeepSeek's PP + 1 stage halves)."""
    for steps in orders(pp, 2, m, schedule=schedule):
        assert sorted(steps) == sorted(Step(k, c, i) for k in "FBW" for c in (0, 1) for i in range(m))
        check_weight_steps(steps)
        for kind, chunk in itertools.product("FBW", (0, 1)):
            assert [s.microbatch for s in steps if (s.kind, s.chunk) == (kind, chunk)] == list(range(m))
        assert max_in_flight(steps) <= V_PEAK[schedule](pp)
        if m >= 2 * pp:
            assert max_in_flight(steps) == V_PEAK[schedule](pp)
    for steps in orders(pp, 2, m, True, schedule):
        assert sorted(steps) == sorted(Step("F", c, i) for c in (0, 1) for i in range(m))


@pytest.mark.parametrize("schedule", V_SCHEDULES)
@pytest.mark.parametrize("pp,m", V_LAYOUTS)
def test_v_simulated_bubble(schedule, pp, m):
    """Step times are a chunk's (half a stage's). ZB-V idles (p - 1) max(B, 2(B - W)) per rank once m >= 2p
    (``zb_v_bubble``), far below ZB-H1's (p - 1)(F + B - W) in stage times; DualPipeV, its pairs run one after
    the other (no overlap on a CPU), stays at or under ZB-H1's bubble. Also with results sent as the
    communication plan batches them, and below 1F1B's with fewer micro batches."""
    for forward_time, backward_time, weight_time in STEP_TIMES:
        for plan in (None, sent_after(pp, 2, m, schedule=schedule)):
            events = simulate(orders(pp, 2, m, schedule=schedule), 2, forward_time, backward_time, plan,
                              weight_time, v_shape=True)
            idle = idle_fractions(events)
            zb_h1 = zb_h1_bubble(pp, m, 2 * forward_time, 2 * backward_time, 2 * weight_time)
            if m < 2 * pp:
                assert max(idle) <= theoretical_bubble(pp, 1, m) + 1e-9
            elif schedule == "zb-v":
                expected = zb_v_bubble(pp, m, forward_time, backward_time, weight_time)
                assert idle == pytest.approx([expected] * pp, abs=1e-9)
                assert expected < zb_h1
            else:
                assert max(idle) <= zb_h1 + 1e-9


@pytest.mark.parametrize("schedule", V_SCHEDULES)
@pytest.mark.parametrize("pp,m", V_LAYOUTS)
def test_v_plan_runs_on_in_order_streams_without_tags(schedule, pp, m):
    assert_plan_runs_in_order(pp, 2, m, schedule)
    assert_plan_needs_no_tags(pp, 2, m, schedule)
    assert_streams_consumed_in_order(pp, 2, m, schedule)


def test_v_placement():
    """pp = 3: rank 0 holds stages 0 and 5 (embedding and loss), rank 2 stages 2 and 3 (the V's tip, handed
    over without a message); chunk 1's activations travel to the previous rank, its gradients to the next."""
    placement = ChunkPlacement(3, 2, v_shape=True)
    assert [[placement.stage(r, c) for c in (0, 1)] for r in range(3)] == [[0, 5], [1, 4], [2, 3]]
    assert [chunk_layers(12, 3, r, 2, c, v_shape=True) for r in range(3) for c in (0, 1)] == \
        [range(0, 2), range(10, 12), range(2, 4), range(8, 10), range(4, 6), range(6, 8)]
    assert [(r, c) for r in range(3) for c in (0, 1) if placement.is_first(r, c)] == [(0, 0)]
    assert [(r, c) for r in range(3) for c in (0, 1) if placement.is_last(r, c)] == [(0, 1)]
    assert placement.result_link(1, "F", 0) == (1, 0, 0) and placement.result_link(1, "F", 1) == (-1, 0, 1)
    assert placement.result_link(2, "F", 0) == (0, 0, 1) and placement.result_link(2, "B", 1) == (0, 1, 0)
    assert placement.result_link(1, "B", 1) == (1, 1, 1) and placement.input_link(1, "B", 1) == (-1, 1, 1)
    assert placement.result_link(0, "F", 1) is None and placement.result_link(0, "B", 0) is None


def test_v_schedule_flags_and_their_one_line_errors():
    assert get_forward_backward_func(2, 2, "zb-v") is forward_backward_pipelining_zb_v
    assert get_forward_backward_func(2, 2, "dualpipev") is forward_backward_pipelining_dualpipev
    flags = ["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--micro-batch-size", "1", "--mock-data",
             "--vocab-size", "256", "--global-batch-size", "3"]
    for schedule in V_SCHEDULES:
        config = parse_config(flags + ["--pipeline-schedule", schedule], world_size=2)
        assert config.virtual_pipeline_size == 2 and config.parallel.v_shape  # 3 micro batches: any m runs
        for extra, message in [
            (["--num-layers-per-virtual-pipeline-stage", "1"], f"{schedule} places two model chunks per rank in a V"),
            (["--num-layers", "6"], "needs --num-layers 6 divisible by 2 \\* --pipeline-model-parallel-size 2"),
            (["--pipeline-model-parallel-size", "1"], f"{schedule} needs --pipeline-model-parallel-size > 1"),
        ]:
            with pytest.raises(ConfigError, match=message) as error:
                parse_config(flags + ["--pipeline-schedule", schedule] + extra, world_size=2)
            assert "\n" not in str(error.value)
