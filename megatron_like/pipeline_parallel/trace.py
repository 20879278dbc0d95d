"""What a pipeline schedule did: which rank ran which forward/backward, and when.

Schedules record one :class:`TraceEvent` per forward (``F``) or backward (``B``) of a micro batch on
a model chunk into a :class:`ScheduleTrace` when one is given or active::

    with record_schedule() as trace:
        train_step(...)
    trace.steps()           # [Step('F', 0, 0), Step('F', 0, 1), Step('B', 0, 0), ...] in execution order
    trace.max_in_flight()   # micro batches forwarded but not yet backwarded, at worst

Times come from ``time.perf_counter`` (CLOCK_MONOTONIC on Linux: comparable across the processes of
one machine), so traces of all ranks can be put on one time axis: :func:`idle_fractions` measures the
pipeline bubble and :func:`chrome_trace` writes a file for chrome://tracing or Perfetto.

:func:`simulate` replays the per-rank step orders with given durations and instantaneous messages:
it proves an order free of deadlocks and gives the bubble the order achieves in theory.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

from megatron_like.pipeline_parallel.placement import ChunkPlacement


class Step(NamedTuple):
    """One unit of schedule work on a micro batch and a chunk: ``kind`` 'F' (forward), 'B' (backward; in the
    zero-bubble schedules only to the chunk's input) or 'W' (the weight gradients of a split backward)."""

    kind: str
    chunk: int
    microbatch: int


@dataclass(frozen=True)
class TraceEvent:
    """A step that ran on pipeline rank ``pp_rank`` from ``start`` to ``end`` (seconds) in schedule call ``run``."""

    pp_rank: int
    run: int
    kind: str
    chunk: int
    microbatch: int
    start: float
    end: float
    comm: float = 0.0
    """Seconds at the end of [start, end] spent issuing the p2p batch that follows the step (the rest is
    compute: the step's result left at ``end - comm``)."""
    wait: float = 0.0
    """Seconds just before ``start`` the rank spent blocked on the step's input (its receive); the rest of the gap
    since the rank's previous step is the executor's own time between steps."""

    @property
    def step(self) -> Step:
        return Step(self.kind, self.chunk, self.microbatch)


@dataclass
class StepTiming:
    """What a schedule adds to the step being recorded: when (``time.perf_counter``) its compute ended
    and it began to issue the p2p batch that follows it, if any."""

    handoff: float | None = None


@dataclass
class ScheduleTrace:
    """Events of one rank, appended by the schedules; every schedule call starts a new ``run``."""

    events: list[TraceEvent] = field(default_factory=list)
    runs: int = 0

    def begin_run(self) -> int:
        self.runs += 1
        return self.runs - 1

    @contextlib.contextmanager
    def span(self, pp_rank: int, run: int, step: Step, waited_since: float | None = None) -> Iterator[StepTiming]:
        """Record the step run inside the block; ``waited_since``: when the rank began to wait for its input."""
        start, timing = time.perf_counter(), StepTiming()
        yield timing
        end = time.perf_counter()
        comm = 0.0 if timing.handoff is None else end - timing.handoff
        wait = 0.0 if waited_since is None else start - waited_since
        self.events.append(TraceEvent(pp_rank, run, step.kind, step.chunk, step.microbatch, start, end, comm, wait))

    def of_run(self, run: int) -> list[TraceEvent]:
        return [e for e in self.events if e.run == run]

    def steps(self, run: int | None = None) -> list[Step]:
        """The steps in execution order (of one schedule call, or of all)."""
        return [e.step for e in (self.events if run is None else self.of_run(run))]

    def max_in_flight(self, run: int | None = None) -> int:
        """Most (chunk, micro batch) pairs whose forward ran and whose backward had not yet, at any time."""
        return max_in_flight(self.steps(run))

    def to_dicts(self) -> list[dict]:
        """Plain dicts (to return from a process or write as JSON)."""
        return [asdict(e) for e in self.events]


def max_in_flight(steps: Sequence[Step]) -> int:
    """Peak number of (chunk, micro batch) pairs held between their forward and their backward (B): those
    whose whole activations are kept."""
    return _peak_live(steps, "B")


def max_awaiting_weights(steps: Sequence[Step]) -> int:
    """Peak number of (chunk, micro batch) pairs between their forward and their last backward step: W where
    the order has W steps (the weight gradients still keep the inputs of the GEMMs), else B."""
    return _peak_live(steps, "W" if any(step.kind == "W" for step in steps) else "B")


def _peak_live(steps: Sequence[Step], released_by: str) -> int:
    live: set[tuple[int, int]] = set()
    peak = 0
    for kind, chunk, microbatch in steps:
        if kind == "F":
            live.add((chunk, microbatch))
            peak = max(peak, len(live))
        elif kind == released_by:
            live.discard((chunk, microbatch))
    return peak


# ---------------------------------------------------------------- the active trace
_active: ScheduleTrace | None = None


@contextlib.contextmanager
def record_schedule(trace: ScheduleTrace | None = None) -> Iterator[ScheduleTrace]:
    """Make every schedule call inside the block record into ``trace`` (a new one by default)."""
    global _active
    previous, _active = _active, trace or ScheduleTrace()
    try:
        yield _active
    finally:
        _active = previous


def active_trace() -> ScheduleTrace | None:
    """The trace of the innermost :func:`record_schedule` block, if any."""
    return _active


# ---------------------------------------------------------------- the bubble
def theoretical_bubble(pp_size: int, vp_size: int, num_microbatches: int) -> float:
    """Idle fraction of 1F1B (vp = 1) and interleaved 1F1B: ``(p - 1) / (v * m + p - 1)``."""
    return (pp_size - 1) / (vp_size * num_microbatches + pp_size - 1)


def idle_fractions(events_per_rank: Sequence[Sequence[TraceEvent]]) -> list[float]:
    """Per rank, the share of the window [first start, last end] over *all* ranks spent outside F/B steps."""
    starts = [e.start for events in events_per_rank for e in events]
    ends = [e.end for events in events_per_rank for e in events]
    window = max(ends) - min(starts)
    return [1.0 - sum(e.end - e.start for e in events) / window for events in events_per_rank]


def input_source(placement: ChunkPlacement, pp_rank: int, step: Step) -> tuple[int, Step] | None:
    """The (rank, step) whose result ``step`` of rank ``pp_rank`` takes as input: a forward's is the same micro
    batch's forward on the previous virtual stage, a B's the backward on the next one; None for the first stage's
    forwards, the last stage's backwards and W steps."""
    holder = placement.input_holder(pp_rank, step.kind, step.chunk)
    return None if holder is None else (holder[0], Step(step.kind, holder[1], step.microbatch))


def simulate(orders: Sequence[Sequence[Step]], num_chunks: int, forward_time: float = 1.0,
             backward_time: float = 2.0, sent_after: Sequence[Sequence[int]] | None = None,
             weight_time: float = 1.0, v_shape: bool = False, durations: Sequence[Sequence[float]] | None = None,
             latency: float = 0.0) -> list[list[TraceEvent]]:
    """Replay per-rank step orders (``orders[pp_rank]``) with fixed step durations and instant messages, or with
    ``durations[pp_rank][i]`` for step ``i`` of a rank (e.g. each step's time measured in a run) and messages that
    take ``latency`` to arrive.

    A forward waits for the same micro batch's forward on the previous virtual stage, a backward runs after
    its own forward and waits for the backward on the next stage (stages placed on the ring, or on the V
    with ``v_shape``: ``placement.py``); a W step runs after its own B and sends nothing. A
    step's result leaves when the step ends, or when
    step ``sent_after[rank][i]`` of its rank ends (a communication plan that batches it with a later
    step's). Raises RuntimeError if the orders deadlock.
    """
    pp = len(orders)
    done: dict[tuple[int, Step], float] = {}  # (rank, step) -> when its result left for the neighbour
    held: list[dict[int, list[Step]]] = [{} for _ in range(pp)]  # results held until step i of the rank ends
    ran: list[set[Step]] = [set() for _ in range(pp)]
    position, clock = [0] * pp, [0.0] * pp
    events: list[list[TraceEvent]] = [[] for _ in range(pp)]

    placement = ChunkPlacement(pp, num_chunks, v_shape)

    def dependencies(rank: int, step: Step) -> list[tuple[int, Step]]:
        source = input_source(placement, rank, step)
        return [] if source is None else [source]

    progressed = True
    while progressed:
        progressed = False
        for rank in range(pp):
            while position[rank] < len(orders[rank]):
                step = orders[rank][position[rank]]
                needed = dependencies(rank, step) if step.kind != "W" else []
                before = {"F": None, "B": "F", "W": "B"}[step.kind]
                own_earlier_ran = before is None or Step(before, step.chunk, step.microbatch) in ran[rank]
                if any(d not in done for d in needed) or not own_earlier_ran:
                    break
                start = max([clock[rank]] + [done[d] + latency for d in needed])
                index = position[rank]
                end = start + (durations[rank][index] if durations is not None
                               else {"F": forward_time, "B": backward_time, "W": weight_time}[step.kind])
                clock[rank] = end
                held[rank].setdefault(sent_after[rank][index] if sent_after else index, []).append(step)
                for sent in held[rank].pop(index, []):
                    done[(rank, sent)] = end
                events[rank].append(TraceEvent(rank, 0, step.kind, step.chunk, step.microbatch, start, end))
                ran[rank].add(step)
                position[rank] += 1
                progressed = True
    stuck = {rank: orders[rank][position[rank]] for rank in range(pp) if position[rank] < len(orders[rank])}
    if stuck:
        raise RuntimeError(f"schedule deadlocks: ranks wait at {stuck}")
    return events


def simulate_in_order_batches(batches: Sequence[Sequence[Sequence[tuple[str, int, int]]]]) -> None:
    """Raise RuntimeError if these p2p batches deadlock when each rank runs its batches strictly in order.

    ``batches[rank]`` lists the batches a rank issues, each a list of ``("send" | "recv", peer, tag)``.
    The model is NCCL's (the conservative reading): a rank's batches run one after the other on one
    stream, an operation completes only while the batches holding it and its peer's matching operation
    are both running, and a batch ends when all its operations have. Matching is FIFO per
    (sender, receiver, tag), as in p2p.py. Gloo never blocks a rank on its sends, so whatever passes here
    also runs on gloo.
    """
    # Name every operation by its message: (sender, receiver, tag, k-th message of that stream).
    named: list[list[set[tuple[int, int, int, int]]]] = []
    for rank, rank_batches in enumerate(batches):
        counts: dict[tuple, int] = {}
        named.append([])
        for batch in rank_batches:
            messages = set()
            for kind, peer, tag in batch:
                stream = (rank, peer, tag) if kind == "send" else (peer, rank, tag)
                counts[(kind, stream)] = counts.get((kind, stream), 0) + 1
                messages.add((*stream, counts[(kind, stream)]))
            named[-1].append(messages)
    position, completed = [0] * len(batches), set()
    while any(position[r] < len(named[r]) for r in range(len(named))):
        running = [named[r][position[r]] if position[r] < len(named[r]) else set() for r in range(len(named))]
        for rank, messages in enumerate(running):
            completed |= {m for m in messages if m in running[m[1] if m[0] == rank else m[0]]}
        finished = [r for r, messages in enumerate(running) if messages and messages <= completed]
        if not finished:
            raise RuntimeError(f"p2p batches deadlock: ranks stuck at batches {position}")
        for rank in finished:
            position[rank] += 1


def chrome_trace(events_per_rank: Sequence[Sequence[TraceEvent]]) -> dict:
    """The events in Chrome's trace format (one row per pipeline rank; load in chrome://tracing)."""
    origin = min(e.start for events in events_per_rank for e in events)
    return {"traceEvents": [
        {"name": f"{e.kind}{e.microbatch}" + (f".{e.chunk}" if e.chunk else ""), "ph": "X", "pid": 0,
         "tid": e.pp_rank, "ts": (e.start - origin) * 1e6, "dur": (e.end - e.start) * 1e6,
         "args": {"run": e.run, "chunk": e.chunk, "microbatch": e.microbatch}}
        for events in events_per_rank for e in events
    ]}
