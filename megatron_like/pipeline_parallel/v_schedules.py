"""The V-shaped schedules, ZB-V and DualPipeV, as step lists (two chunks per rank, ``placement.py``'s V).

Rank ``r`` holds chunk 0 = virtual stage ``r`` and chunk 1 = stage ``2p - 1 - r``: a micro batch goes down the
ranks on chunk 0 and back up on chunk 1, and its loss is computed on rank 0. Each backward is split into B
(input gradient) and W (weight gradients) as in ``zero_bubble.py``.

**ZB-V** (:func:`zb_v_steps`; Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 6). Rank ``r``
warms up with ``2(p - r) - 1`` forwards of chunk 0, then ``r`` pairs (F of chunk 1, F of chunk 0), then
``p - r`` triples (F, B, W of chunk 1); the steady phase repeats ``F0 B0 W0 F1 B1 W1`` (one new micro batch
on each chunk); the cooldown runs ``r`` pairs (B0, B1), then ``p - r`` pairs (B0 and the oldest waiting W0),
then the waiting W steps. A rank holds the activations of at most ``2p`` chunk micro batches, i.e. ``p`` whole
stages' worth: 1F1B's first-stage bound, on every rank. With equal step times its bubble is nearly zero.

**DualPipeV** (:func:`dualpipev_steps`; DeepSeek-AI's DualPipe, "cut in half" into a V, as in their
``dualpipev.py`` and torch's ``ScheduleDualPipeV``). Its steady phase pairs the forward of one micro batch on
one chunk with the backward of another micro batch on the other chunk (``F0 + B1``, then ``F1 + B0``). On a GPU
the two halves of a pair overlap (one's compute hides the other's all-to-all, on separate streams); on the CPU
here a pair is two consecutive steps, so what this code reproduces is DualPipeV's order and memory, not that
overlap. Its backwards are whole (B then W at once) except near the end, where the W steps of the last
backwards wait in a queue and fill the cooldown. Rank ``r``: ``2(p - r - 1)`` forwards of chunk 0; ``r + 1``
pairs (F0, F1); ``p - r - 1`` of (B1 W1, F1); the steady pairs; ``p - r - 1`` of (B1 W1, F1 + B0 W0); ``r + 1`` of
(B1, B0) whose W steps start waiting halfway; ``p - r - 1`` of (oldest W, B0); the remaining W steps.

Both orders are written for at least ``2p`` micro batches (DualPipeV's minimum); with fewer, the steps of the
missing micro batches are dropped, which keeps every rank's order a subsequence of a deadlock-free one (the
dependencies left are a subset), so it stays deadlock-free (the simulator tests check every layout).
"""

from __future__ import annotations

from collections import deque

from megatron_like.pipeline_parallel.trace import Step, idle_fractions, simulate
from megatron_like.pipeline_parallel.zero_bubble import zb_h1_bubble


class _Order:
    """A rank's step list under construction: counts of the forwards and backwards issued per chunk, and the
    W steps left waiting (in the order their B ran)."""

    def __init__(self) -> None:
        self.steps: list[Step] = []
        self.forwards, self.backwards = [0, 0], [0, 0]
        self.waiting: deque[Step] = deque()

    def forward(self, chunk: int) -> None:
        self.steps.append(Step("F", chunk, self.forwards[chunk]))
        self.forwards[chunk] += 1

    def backward(self, chunk: int, weight_now: bool) -> None:
        """B of the next micro batch of ``chunk``, with its W right after (``weight_now``) or left waiting."""
        microbatch = self.backwards[chunk]
        self.backwards[chunk] += 1
        self.steps.append(Step("B", chunk, microbatch))
        if weight_now:
            self.steps.append(Step("W", chunk, microbatch))
        else:
            self.waiting.append(Step("W", chunk, microbatch))

    def weight(self) -> None:
        """The oldest waiting W."""
        self.steps.append(self.waiting.popleft())

    def finish(self, num_microbatches: int, forward_only: bool) -> list[Step]:
        while self.waiting:
            self.weight()
        steps = [step for step in self.steps if step.microbatch < num_microbatches]
        return [step for step in steps if step.kind == "F"] if forward_only else steps


def zb_v_steps(pp_size: int, pp_rank: int, num_microbatches: int, forward_only: bool = False) -> list[Step]:
    """The ZB-V order of rank ``pp_rank`` (see the module docstring); ``forward_only``: its forwards alone."""
    p, r, m = pp_size, pp_rank, max(num_microbatches, 2 * pp_size)
    order = _Order()
    for _ in range(2 * (p - r) - 1):
        order.forward(0)
    for _ in range(r):
        order.forward(1)
        order.forward(0)
    for _ in range(p - r):
        order.forward(1)
        order.backward(1, weight_now=True)
    while order.forwards[1] < order.forwards[0] or order.forwards[0] < m:
        if order.forwards[0] < m:
            order.forward(0)
        order.backward(0, weight_now=True)
        order.forward(1)
        order.backward(1, weight_now=True)
    for _ in range(r):
        order.backward(0, weight_now=False)
        order.backward(1, weight_now=False)
    for _ in range(p - r):
        order.backward(0, weight_now=False)
        order.weight()
    return order.finish(num_microbatches, forward_only)


def dualpipev_steps(pp_size: int, pp_rank: int, num_microbatches: int, forward_only: bool = False) -> list[Step]:
    """The DualPipeV order of rank ``pp_rank`` (see the module docstring); ``forward_only``: its forwards alone.

    A pair ``F0 + B1`` is written F0, then B1 and its W: the forward's input arrives first in the V."""
    p, r, m = pp_size, pp_rank, max(num_microbatches, 2 * pp_size)
    order = _Order()
    for _ in range(2 * (p - r - 1)):
        order.forward(0)
    for _ in range(r + 1):
        order.forward(0)
        order.forward(1)
    for _ in range(p - r - 1):
        order.backward(1, weight_now=True)
        order.forward(1)
    for _ in range(m - 2 * p + r + 1):
        order.forward(0)
        order.backward(1, weight_now=True)
        order.forward(1)
        order.backward(0, weight_now=True)
    for _ in range(p - r - 1):
        order.backward(1, weight_now=True)
        order.forward(1)
        order.backward(0, weight_now=True)
    # The last r + 1 backwards of each chunk: from halfway on (odd ranks before B1, even ones before B0) their
    # W steps wait, to fill the cooldown.
    for i in range(r + 1):
        halfway = i >= (r + 1) // 2
        order.backward(1, weight_now=not (halfway and r % 2 == 1))
        order.backward(0, weight_now=not halfway)
    for _ in range(p - r - 1):
        order.weight()
        order.backward(0, weight_now=False)
    return order.finish(num_microbatches, forward_only)


def zb_v_bubble(pp_size: int, num_microbatches: int, forward_time: float, backward_time: float,
                weight_time: float) -> float:
    """Idle fraction of a rank under :func:`zb_v_steps` with these step times of one chunk (half a stage):
    ``(p-1) max(B, 2(B-W)) / (2m(F+B+W) + (p-1) max(B, 2(B-W)))`` for ``m >= 2p`` and ``F <= B``.

    The idle time does not depend on F: the first B reaches rank ``r`` one B per rank later than rank
    ``r - 1``'s, and in the cooldown a rank waits for the B of the next rank unless its own waiting W
    steps cover it (``2(B - W)`` per rank when W is short). Found on the event simulator for every layout
    and step times tested (``tests/distributed/test_zero_bubble_schedules.py``), not derived in closed form.
    """
    idle = (pp_size - 1) * max(backward_time, 2 * (backward_time - weight_time))
    return idle / (2 * num_microbatches * (forward_time + backward_time + weight_time) + idle)


def zero_bubble_schedule_bubble(schedule: str, pp_size: int, num_microbatches: int, forward_time: float,
                                backward_time: float, weight_time: float) -> float:
    """Idle fraction of ``zb-h1``, ``zb-v`` or ``dualpipev`` with these step times of a whole stage: ZB-H1's and
    ZB-V's formulas (a V chunk's times are half a stage's); DualPipeV's by simulating its order (no closed
    form without the overlap of its pairs), with ``m`` at least ``2p`` there."""
    if schedule == "zb-h1":
        return zb_h1_bubble(pp_size, num_microbatches, forward_time, backward_time, weight_time)
    chunk_times = (forward_time / 2, backward_time / 2, weight_time / 2)
    if schedule == "zb-v":
        return zb_v_bubble(pp_size, num_microbatches, *chunk_times)
    events = simulate([dualpipev_steps(pp_size, r, num_microbatches) for r in range(pp_size)], 2, chunk_times[0],
                      chunk_times[1], weight_time=chunk_times[2], v_shape=True)
    return max(idle_fractions(events))
