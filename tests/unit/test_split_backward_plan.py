"""The planner's W stash (planning/split_backward.py) against what a layer's B step really leaves for its W, and
the order-based peak counting it feeds."""

from __future__ import annotations

import pytest

from megatron_like.config import parse_config
from megatron_like.pipeline_parallel import Step
from megatron_like.planning.split_backward import Stash, held_at_peak, layer_stash
from tests.saved_tensors import kept_for_weight_grads
from tests.unit.test_plan import LAYER, LLAMA, MLA, MOE

CASES = {"gpt": [], "llama": LLAMA, "llama-bf16": LLAMA + ["--bf16"], "gpt-moe": ["--disable-bias-linear"] + MOE,
         "llama-moe-bf16": LLAMA + MOE + ["--bf16"], "mla": MLA}


@pytest.mark.parametrize("extra", list(CASES.values()), ids=list(CASES))
def test_layer_stash_formula_equals_what_a_b_step_keeps_for_w(extra):
    config = parse_config(LAYER + extra)
    assert layer_stash(config).total == pytest.approx(kept_for_weight_grads(config), rel=0.02)


def test_held_at_peak_counts_whole_micro_batches_and_waiting_stashes():
    """ZB-H1's last rank of 2 (F0 B0 F1 B1 W0 B... ): the stash of micro batch 0 waits while micro batch 1 is whole;
    a B step adds the running layer's output gradients; without W steps a B frees its micro batch."""
    steps = [Step("F", 0, 0), Step("B", 0, 0), Step("F", 0, 1), Step("B", 0, 1), Step("W", 0, 0), Step("W", 0, 1)]
    peak = held_at_peak(steps, [10.0], [Stash(3.0, 4.0)], backward_peak=1.0)
    assert (peak.whole, peak.waiting, peak.in_backward) == ((1,), (1,), 0)  # 10 + 7 + 1 at B1
    plain = [step for step in steps if step.kind != "W"]
    assert held_at_peak(plain, [10.0], [Stash(0.0, 0.0)], backward_peak=1.0).waiting == (0,)
