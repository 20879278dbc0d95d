"""``benchmarks/zero_bubble_at_scale.py`` replays each schedule's orders on GPT-3 175B's 16 stages: its simulated
iterations give each schedule's own bubble formula (so the table's gains come from the orders, not from the
plumbing), and the planner's 175B stage time per micro batch is what its FLOPs say."""

from __future__ import annotations

import os
import sys

import pytest

from megatron_like.pipeline_parallel.trace import theoretical_bubble
from megatron_like.pipeline_parallel.v_schedules import zb_v_bubble
from megatron_like.pipeline_parallel.zero_bubble import zb_h1_bubble

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import zero_bubble_at_scale as bench  # noqa: E402

F, B, W = 1.0, 1.2, 0.9  # a stage's step times, W shorter than B as measured on CPU


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved (v = 3)", "zb-h1", "zb-v"])
def test_simulated_iteration_gives_each_schedules_bubble(schedule):
    m = 32
    split = schedule.startswith("zb")
    iteration = bench.simulated_iteration(schedule, m, F, B if split else B + W, W if split else 0.0)
    bubble = 1.0 - m * (F + B + W) / iteration
    expected = {"1f1b": theoretical_bubble(bench.PP, 1, m), "interleaved (v = 3)": theoretical_bubble(bench.PP, 3, m),
                "zb-h1": zb_h1_bubble(bench.PP, m, F, B, W), "zb-v": zb_v_bubble(bench.PP, m, F / 2, B / 2, W / 2)}
    assert bubble == pytest.approx(expected[schedule], rel=1e-9), schedule


def test_stage_time_is_the_planners_flops_over_the_devices_and_micro_batches():
    from megatron_like.config import parse_config
    from megatron_like.planning.simulator import plan_run

    config = parse_config(bench.GPT3_175B + ["--global-batch-size", "1536"], world_size=bench.WORLD)
    plan = plan_run(config, config.padded_vocab_size(bench.VOCAB))
    assert config.num_microbatches == 192 and 174e9 < plan.total_params < 176e9
    # no bubble in it: the simulation adds each schedule's own
    expected = plan.flops_per_iteration / bench.WORLD / (312e12 * 0.45) / 192
    assert bench.stage_seconds_per_microbatch(1536) == pytest.approx(expected, rel=1e-9)
