"""benchmarks/pipeline_bubble.py's analysis on traces whose answer is known: traces made by the event simulator
with uneven step times and a message latency. The measured bubble must equal the theory at the trace's own step
times plus the latency the analysis reads from the trace, and exceed the theory with instant messages."""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest

from megatron_like.pipeline_parallel import dualpipev_steps, one_f_one_b_steps, zb_h1_steps, zb_v_steps
from megatron_like.pipeline_parallel.comm_plan import communication_plan, in_order_plans, sent_after
from megatron_like.pipeline_parallel.trace import simulate

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import pipeline_bubble  # noqa: E402

ORDERS = {"1f1b": (one_f_one_b_steps, 1), "zb-h1": (zb_h1_steps, 1), "zb-v": (zb_v_steps, 2),
          "dualpipev": (dualpipev_steps, 2)}
LATENCY = 0.05


def simulated_trace(name: str, p: int, m: int) -> list:
    """Every rank's events as the executor would trace them: steps of uneven lengths (by rank, kind and micro
    batch), messages that take LATENCY, every gap spent waiting for the step's input."""
    order_of, v = ORDERS[name]
    orders = [order_of(p, rank, m) for rank in range(p)]
    v_shape = v == 2
    posts = in_order_plans(orders, p, v, v_shape=True) if v_shape else \
        [communication_plan(order, p, rank, v) for rank, order in enumerate(orders)]
    sends = [sent_after(len(order), rank_posts) for order, rank_posts in zip(orders, posts)]
    durations = [[{"F": 1.0, "B": 1.3, "W": 0.7}[s.kind] * (1 + 0.1 * rank + 0.03 * (s.microbatch % 3))
                  for s in order] for rank, order in enumerate(orders)]
    events = simulate(orders, v, sent_after=sends, v_shape=v_shape, durations=durations, latency=LATENCY)
    for rank_events, rank_durations in zip(events, durations):
        assert [e.end - e.start for e in rank_events] == pytest.approx(rank_durations)
    traced = []
    for rank_events in events:
        previous_end, rank_traced = rank_events[0].start, []
        for event in rank_events:
            rank_traced.append(dataclasses.replace(event, wait=event.start - previous_end))
            previous_end = event.end
        traced.append(rank_traced)
    return traced


@pytest.mark.parametrize("name", list(ORDERS))
@pytest.mark.parametrize("p", [2, 4])
def test_bubble_analysis_recovers_the_simulated_latency_and_bubble(name, p):
    analysis = pipeline_bubble.analyse(name, p, ORDERS[name][1], 8, simulated_trace(name, p, 8))
    assert analysis["latency"] == pytest.approx(LATENCY)
    assert analysis["measured"] == pytest.approx(analysis["theory_latency"], rel=1e-9)
    assert analysis["measured"] > analysis["theory"] * 1.001
    assert analysis["overhead"] == pytest.approx(0.0, abs=1e-12)
