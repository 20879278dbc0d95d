"""The pipeline schedules' step orders, checked without processes: every micro batch runs once, 1F1B's
memory bound, deadlock freedom and the bubble (by simulation), FIFO-consistent message streams, and
the up-front errors."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

from megatron_like.config import ConfigError, parse_config
from megatron_like.config.parallel import V_SCHEDULES
from megatron_like.parallel_state import ParallelState
from megatron_like.pipeline_parallel import (
    PipelineP2P,
    Step,
    check_pipeline_schedule,
    forward_backward_no_pipelining,
    forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_without_interleaving,
    get_forward_backward_func,
    in_order_plans,
    interleaved_steps,
    one_f_one_b_steps,
    pipeline_tensor_shape,
    zb_h1_steps,
)
from megatron_like.pipeline_parallel.comm_plan import Post
from megatron_like.pipeline_parallel.comm_plan import sent_after as plan_sent_after
from megatron_like.pipeline_parallel.trace import (
    chrome_trace,
    idle_fractions,
    max_in_flight,
    simulate,
    simulate_in_order_batches,
    theoretical_bubble,
)
from megatron_like.pipeline_parallel.v_schedules import dualpipev_steps, zb_v_steps
from tests.distributed.megatron_order import megatron_order

NAMED_ORDERS = {"zb-h1": zb_h1_steps, "zb-v": zb_v_steps, "dualpipev": dualpipev_steps}
LAYOUTS = [(pp, 1, m) for pp in (2, 3, 4, 8) for m in (1, 2, 3, 4, 7, 8, 16)]
LAYOUTS += [(pp, vp, m) for pp in (2, 3, 4) for vp in (2, 3, 4) for m in (pp, 2 * pp, 4 * pp)]


def orders(pp: int, vp: int, m: int, forward_only: bool = False, schedule: str | None = None) -> list[list[Step]]:
    """Every rank's step order: 1F1B (vp 1), interleaved, or the named schedule."""
    if schedule in NAMED_ORDERS:
        return [NAMED_ORDERS[schedule](pp, r, m, forward_only) for r in range(pp)]
    if vp == 1:
        return [one_f_one_b_steps(pp, r, m, forward_only) for r in range(pp)]
    return [interleaved_steps(pp, r, m, vp, forward_only) for r in range(pp)]


@pytest.mark.parametrize("pp,vp,m", LAYOUTS)
def test_every_micro_batch_runs_forward_then_backward_once_per_chunk(pp, vp, m):
    for steps in orders(pp, vp, m):
        assert sorted(steps) == sorted(Step(k, c, i) for k in "BF" for c in range(vp) for i in range(m))
        position = {step: n for n, step in enumerate(steps)}
        assert all(position[Step("F", c, i)] < position[Step("B", c, i)] for c in range(vp) for i in range(m))
        for kind, chunk in itertools.product("FB", range(vp)):  # each chunk sees micro batches in order
            microbatches = [s.microbatch for s in steps if (s.kind, s.chunk) == (kind, chunk)]
            assert microbatches == list(range(m))
    for steps in orders(pp, vp, m, forward_only=True):
        assert {s.kind for s in steps} == {"F"} and len(steps) == vp * m


def _spell(order: list) -> str:
    """``[Step("F", 1, 0), ...]`` -> ``"F1.0 ..."`` (kind, chunk.micro batch)."""
    return " ".join(f"{kind}{chunk}.{microbatch}" for kind, chunk, microbatch in order)


# Hand-written orders (kind, chunk . micro batch), derived on paper from Megatron-LM's interleaved schedule:
# p=2, v=2, m=4 -> rank 0 warms up with (2-0-1)*2 + (2-1)*2 = 4 forwards, rank 1 with 2.
HAND_WRITTEN = {
    (2, 2, 4): [
        "F0.0 F0.1 F1.0 F1.1 F0.2 B1.0 F0.3 B1.1 F1.2 B0.0 F1.3 B0.1 B1.2 B1.3 B0.2 B0.3",
        "F0.0 F0.1 F1.0 B1.0 F1.1 B1.1 F0.2 B0.0 F0.3 B0.1 F1.2 B1.2 F1.3 B1.3 B0.2 B0.3",
    ],
    # m == p: rank 0's warmup (2 + 2) covers all m * v = 4 forwards; rank 1 still interleaves.
    (2, 2, 2): [
        "F0.0 F0.1 F1.0 F1.1 B1.0 B1.1 B0.0 B0.1",
        "F0.0 F0.1 F1.0 B1.0 F1.1 B1.1 B0.0 B0.1",
    ],
    (2, 1, 3): ["F0.0 F0.1 B0.0 F0.2 B0.1 B0.2", "F0.0 B0.0 F0.1 B0.1 F0.2 B0.2"],
}


@pytest.mark.parametrize("pp,vp,m", list(HAND_WRITTEN))
def test_orders_match_hand_written_megatron_orders(pp, vp, m):
    for rank, expected in enumerate(HAND_WRITTEN[(pp, vp, m)]):
        assert _spell(orders(pp, vp, m)[rank]) == expected, f"rank {rank}"
        assert _spell(megatron_order(pp, rank, m, vp)) == expected, f"the oracle itself, rank {rank}"


@pytest.mark.parametrize("pp,vp,m", LAYOUTS)
def test_orders_equal_megatrons_restated_independently(pp, vp, m):
    for forward_only in (False, True):
        for rank, steps in enumerate(orders(pp, vp, m, forward_only)):
            assert _spell(steps) == _spell(megatron_order(pp, rank, m, vp, forward_only)), f"rank {rank}"


@pytest.mark.parametrize("pp,m", [(pp, m) for pp, vp, m in LAYOUTS if vp == 1])
def test_1f1b_warmup_steady_cooldown_and_in_flight_bound(pp, m):
    for rank, steps in enumerate(orders(pp, 1, m)):
        warmup = min(pp - rank - 1, m)
        kinds = "".join(s.kind for s in steps)
        assert kinds == "F" * warmup + "FB" * (m - warmup) + "B" * warmup
        assert max_in_flight(steps) == min(pp - rank, m)


@pytest.mark.parametrize("pp,vp,m", [layout for layout in LAYOUTS if layout[1] > 1])
def test_interleaved_in_flight_bound(pp, vp, m):
    for rank, steps in enumerate(orders(pp, vp, m)):
        warmup = min(2 * (pp - rank - 1) + (vp - 1) * pp, vp * m)
        assert all(s.kind == "F" for s in steps[:warmup])
        assert max_in_flight(steps) == min(warmup + 1, vp * m)


@functools.cache
def plans(pp: int, vp: int, m: int, forward_only: bool = False, schedule: str | None = None) -> list[list[Post]]:
    """Every rank's communication plan as the executor computes it (cached: the V's takes a replay to make)."""
    return in_order_plans(orders(pp, vp, m, forward_only, schedule), pp, vp, schedule in V_SCHEDULES)


def sent_after(pp: int, vp: int, m: int, forward_only: bool = False, schedule: str | None = None) -> list[list[int]]:
    """Per rank, for each step, the step after which the communication plan sends its result."""
    rank_orders, rank_plans = orders(pp, vp, m, forward_only, schedule), plans(pp, vp, m, forward_only, schedule)
    return [plan_sent_after(len(steps), posts) for steps, posts in zip(rank_orders, rank_plans)]


@pytest.mark.parametrize("pp,vp,m", LAYOUTS)
def test_simulated_schedule_has_no_deadlock_and_the_theoretical_bubble(pp, vp, m):
    for forward_time, backward_time in ((1.0, 2.0), (1.0, 1.0)):
        for plan in (None, sent_after(pp, vp, m)):  # results sent at once, and as the communication plan does
            events = simulate(orders(pp, vp, m), vp, forward_time / vp, backward_time / vp, plan)
            assert idle_fractions(events) == pytest.approx([theoretical_bubble(pp, vp, m)] * pp, abs=1e-9)
    simulate(orders(pp, vp, m, forward_only=True), vp, sent_after=sent_after(pp, vp, m, forward_only=True))


def plan_batches(pp: int, vp: int, m: int, forward_only: bool = False,
                 schedule: str | None = None) -> list[list[list[tuple[str, int, int]]]]:
    """Each rank's p2p batches as the executor issues them: on the ring activations (tag 0) go to rank + 1,
    gradients (tag 1) to rank - 1; on the V (zb-v, dualpipev) chunk 1's go the other way."""
    v_shape = schedule in V_SCHEDULES
    batches = []
    every_order = orders(pp, vp, m, forward_only, schedule)
    for rank, (steps, posts) in enumerate(zip(every_order, plans(pp, vp, m, forward_only, schedule))):
        following, preceding = (rank + 1) % pp, (rank - 1) % pp

        def neighbours(step: Step) -> tuple[int, int]:
            """The ranks holding the next and the previous stage of this step's chunk."""
            upwards = v_shape and step.chunk == 1  # the V's chunk 1 runs from the last rank back to rank 0
            return (preceding, following) if upwards else (following, preceding)

        def send(step: Step) -> tuple[str, int, int]:
            return ("send", neighbours(step)[0], 0) if step.kind == "F" else ("send", neighbours(step)[1], 1)

        def receive(step: Step) -> tuple[str, int, int]:
            return ("recv", neighbours(step)[1], 0) if step.kind == "F" else ("recv", neighbours(step)[0], 1)

        batches.append([
            [send(steps[i]) for i in post.sends] + [receive(steps[i]) for i in post.receives]
            for post in posts
        ])
    return batches


@pytest.mark.parametrize("pp,vp,m", LAYOUTS)
def test_communication_plan_cannot_deadlock_on_in_order_streams(pp, vp, m):
    """NCCL runs a rank's batches in order on one stream: the plan must not deadlock under that rule."""
    assert_plan_runs_in_order(pp, vp, m)


def assert_plan_runs_in_order(pp: int, vp: int, m: int, schedule: str | None = None) -> None:
    """The plan of this schedule does not deadlock under NCCL's in-order rule; each receive is posted before
    its step, each send after its step, one operation per direction per batch."""
    simulate_in_order_batches(plan_batches(pp, vp, m, schedule=schedule))
    simulate_in_order_batches(plan_batches(pp, vp, m, forward_only=True, schedule=schedule))
    for steps, posts in zip(orders(pp, vp, m, schedule=schedule), plans(pp, vp, m, schedule=schedule)):
        received = [i for post in posts for i in post.receives]
        sent = [i for post in posts for i in post.sends]
        assert received == sorted(set(received)) and len(sent) == len(set(sent))
        if schedule not in V_SCHEDULES:  # the ring sends in step order (the V in the order its peers receive)
            assert sent == sorted(sent)
        assert all(post.after < i for post in posts for i in post.receives)  # posted before the step runs
        assert all(i <= post.after for post in posts for i in post.sends)  # sent once computed
        if schedule not in V_SCHEDULES:  # the ring: one operation per direction (the V postpones sends)
            assert all(len({steps[i].kind for i in group}) == len(group)
                       for post in posts for group in (post.sends, post.receives))


@pytest.mark.parametrize("pp,vp,m", LAYOUTS)
def test_communication_plan_needs_no_tags(pp, vp, m):
    """NCCL ignores tags: between two ranks, activations and gradients form one stream, so each receiver
    must ask for the kinds of messages in the order its sender sends them, and still never deadlock."""
    assert_plan_needs_no_tags(pp, vp, m)


def assert_plan_needs_no_tags(pp: int, vp: int, m: int, schedule: str | None = None) -> None:
    batches = plan_batches(pp, vp, m, schedule=schedule)
    simulate_in_order_batches([[[(kind, peer, 0) for kind, peer, _ in batch] for batch in rank] for rank in batches])

    def tags(rank: int, operation: str, peer: int) -> list[int]:
        return [tag for batch in batches[rank] for kind, other, tag in batch if (kind, other) == (operation, peer)]

    for sender in range(pp):
        for receiver in {(sender + 1) % pp, (sender - 1) % pp}:
            assert tags(sender, "send", receiver) == tags(receiver, "recv", sender)


def test_in_order_stream_model_catches_the_naive_plan():
    """Sending each result at once and posting each receive a step ahead (enough on gloo) deadlocks on
    in-order streams already for 2 stages and 1 micro batch: each rank first waits for a message that
    its peer posts only after a receive of its own. One batch of both operations on rank 0 runs."""
    rank_1 = [[("recv", 0, 0)], [("send", 0, 1)]]  # F0's input, then B0's gradient
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate_in_order_batches([[[("recv", 1, 1)], [("send", 1, 0)]], rank_1])
    simulate_in_order_batches([[[("recv", 1, 1), ("send", 1, 0)]], rank_1])


def test_simulate_reports_a_deadlock():
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate([[Step("B", 0, 0), Step("F", 0, 0)], [Step("F", 0, 0), Step("B", 0, 0)]], 1)
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate([[Step("F", 0, 0)], [Step("B", 0, 0), Step("F", 0, 0)]], 1)


@pytest.mark.parametrize("pp,vp,m", LAYOUTS)
def test_message_streams_are_consumed_in_the_order_they_are_produced(pp, vp, m):
    """p2p.py sends no header: on each (sender, receiver, direction) the k-th message sent must be the k-th
    the receiver asks for. Forward messages go rank r -> r + 1 (the last rank feeds chunk c + 1 of rank 0)."""
    assert_streams_consumed_in_order(pp, vp, m)


def assert_streams_consumed_in_order(pp: int, vp: int, m: int, schedule: str | None = None) -> None:
    if schedule in V_SCHEDULES:
        return assert_v_streams_consumed_in_order(pp, m, schedule)
    ranks = orders(pp, vp, m, schedule=schedule)
    for rank in range(pp):
        receiver = (rank + 1) % pp
        sent = [(s.chunk + (receiver == 0), s.microbatch) for s in ranks[rank]
                if s.kind == "F" and not (rank == pp - 1 and s.chunk == vp - 1)]
        wanted = [(s.chunk, s.microbatch) for s in ranks[receiver]
                  if s.kind == "F" and not (receiver == 0 and s.chunk == 0)]
        assert sent == wanted
        sender = (rank + 1) % pp  # gradients flow from rank + 1 back to rank
        sent = [(s.chunk - (sender == 0), s.microbatch) for s in ranks[sender]
                if s.kind == "B" and not (sender == 0 and s.chunk == 0)]
        wanted = [(s.chunk, s.microbatch) for s in ranks[rank]
                  if s.kind == "B" and not (rank == pp - 1 and s.chunk == vp - 1)]
        assert sent == wanted


def assert_v_streams_consumed_in_order(pp: int, m: int, schedule: str) -> None:
    """The same on the V: chunk 0 of rank r is stage r, chunk 1 is stage 2pp - 1 - r (restated here, apart from
    placement.py); a result whose next stage is on the same rank is no message."""

    def stage(rank: int, chunk: int) -> int:
        return rank if chunk == 0 else 2 * pp - 1 - rank

    holder = {stage(rank, chunk): rank for rank in range(pp) for chunk in (0, 1)}
    sent: dict[tuple[int, int, int], list[tuple[int, int]]] = {}
    wanted: dict[tuple[int, int, int], list[tuple[int, int]]] = {}
    for rank, steps in enumerate(orders(pp, 2, m, schedule=schedule)):
        for step in steps:
            if step.kind == "W":
                continue
            tag, ahead = (0, 1) if step.kind == "F" else (1, -1)
            here = stage(rank, step.chunk)
            if 0 <= here + ahead < 2 * pp and holder[here + ahead] != rank:
                sent.setdefault((rank, holder[here + ahead], tag), []).append((here + ahead, step.microbatch))
            if 0 <= here - ahead < 2 * pp and holder[here - ahead] != rank:
                wanted.setdefault((holder[here - ahead], rank, tag), []).append((here, step.microbatch))
    assert sent == wanted and len(sent) == (4 * (pp - 1) if m else 0)


def test_constraint_errors_are_one_line_config_errors():
    with pytest.raises(ConfigError, match="multiple of --pipeline-model-parallel-size 4"):
        check_pipeline_schedule(4, 2, 6)
    with pytest.raises(ConfigError, match="needs --pipeline-model-parallel-size > 1"):
        get_forward_backward_func(1, 2)
    with pytest.raises(ConfigError, match="at least one micro batch"):
        check_pipeline_schedule(2, 1, 0)
    check_pipeline_schedule(4, 1, 3)  # 1F1B runs fewer micro batches than stages (with a larger bubble)
    flags = ["--num-layers", "8", "--pipeline-model-parallel-size", "4", "--micro-batch-size", "1", "--mock-data",
             "--vocab-size", "256"]
    with pytest.raises(ConfigError) as error:
        parse_config(flags + ["--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "6"], world_size=4)
    assert "multiple of --pipeline-model-parallel-size 4" in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="--num-layers 6 is not divisible by --pipeline-model-parallel-size 4"):
        parse_config(flags + ["--num-layers", "6"], world_size=4)
    with pytest.raises(ConfigError, match="does not divide"):
        parse_config(flags + ["--num-layers-per-virtual-pipeline-stage", "3"], world_size=4)


def test_schedule_picked_by_layout():
    assert get_forward_backward_func(1) is forward_backward_no_pipelining
    assert get_forward_backward_func(4, 1) is forward_backward_pipelining_without_interleaving
    assert get_forward_backward_func(2, 2) is forward_backward_pipelining_with_interleaving


def test_p2p_shape_from_config_and_mismatch_message():
    assert pipeline_tensor_shape(32, 2, 64) == (32, 2, 64)
    assert pipeline_tensor_shape(32, 2, 64, tp_size=4, sequence_parallel=True) == (8, 2, 64)
    assert pipeline_tensor_shape(32, 2, 64, tp_size=4) == (32, 2, 64)
    p2p = PipelineP2P(ParallelState.single_process(torch.device("cpu")), (32, 2, 64), torch.float32)
    with pytest.raises(ValueError, match=r"\(16, 2, 64\) torch.float32 tensor but the configured pipeline tensor"):
        p2p.post([(torch.zeros(16, 2, 64), 1, 0)])


def test_trace_helpers():
    events = simulate(orders(2, 1, 2), 1)
    assert idle_fractions(events) == pytest.approx([1 / 3, 1 / 3])
    rows = chrome_trace(events)["traceEvents"]
    assert len(rows) == 8 and {r["tid"] for r in rows} == {0, 1} and rows[0]["name"] == "F0"
