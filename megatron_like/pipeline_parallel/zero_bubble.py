"""Zero-bubble pipeline schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024) as step lists.

Each micro batch's backward is split into ``B`` (the gradient of the chunk's input: what the previous stage
waits for) and ``W`` (the weight gradients: nobody waits for them), see ``tensor_parallel/weight_grad.py``.
A ``W`` step can run whenever the rank would otherwise wait, which is what removes the bubble.

**ZB-H1** (:func:`zb_h1_steps`): 1F1B's order with the ``W`` of each micro batch placed in it. Rank ``r`` runs
1F1B's ``p - r - 1`` warmup forwards and its forward/backward alternation unchanged (so it holds the full
activations of at most ``p - r`` micro batches, as in 1F1B), and puts ``W`` of micro batch ``i - r`` right
after ``B`` of micro batch ``i``: later ranks keep ``r`` weight gradients waiting, so every rank has ``p``
micro batches between forward and ``W``, the first rank's 1F1B count. The waiting ``W`` steps fill the
cooldown. With step times ``F``, ``B``, ``W`` (``W <= B``) and ``m >= p`` micro batches each rank idles
``(p - 1)(F + B - W)`` instead of 1F1B's ``(p - 1)(F + B + W)``: about a third when the three are equal
(:func:`zb_h1_bubble`; ``tests/distributed/test_zero_bubble_schedules.py`` checks it by simulation).
"""

from __future__ import annotations

from megatron_like.pipeline_parallel.trace import Step


def zb_h1_steps(pp_size: int, pp_rank: int, num_microbatches: int, forward_only: bool = False) -> list[Step]:
    """The ZB-H1 order of rank ``pp_rank``: 1F1B's forwards and backwards, ``W(i - r)`` after each ``B(i)``,
    then the remaining ``W`` steps."""
    m = num_microbatches
    if forward_only:
        return [Step("F", 0, i) for i in range(m)]
    warmup = min(pp_size - pp_rank - 1, m)
    steps = [Step("F", 0, i) for i in range(warmup)]
    weights_done = 0
    for i in range(m):
        if warmup + i < m:
            steps.append(Step("F", 0, warmup + i))
        steps.append(Step("B", 0, i))
        if i >= pp_rank:
            steps.append(Step("W", 0, weights_done))
            weights_done += 1
    steps += [Step("W", 0, i) for i in range(weights_done, m)]
    return steps


def zb_h1_bubble(pp_size: int, num_microbatches: int, forward_time: float, backward_time: float,
                 weight_time: float) -> float:
    """Idle fraction of a rank under ZB-H1 with these step times: ``(p-1)(F+B-W) / (m(F+B+W) + (p-1)(F+B-W))``
    (for ``m >= p`` and ``W <= B``, the paper's setting)."""
    idle = (pp_size - 1) * (forward_time + backward_time - weight_time)
    return idle / (num_microbatches * (forward_time + backward_time + weight_time) + idle)


def check_weight_steps(steps: list[Step]) -> None:
    """Raise ValueError unless every (chunk, micro batch) with a ``B`` has exactly one ``W``, after it."""
    backwards, weights = set(), set()
    for step in steps:
        key = (step.chunk, step.microbatch)
        if step.kind == "B":
            backwards.add(key)
        elif step.kind == "W":
            if key not in backwards:
                raise ValueError(f"W of micro batch {step.microbatch} (chunk {step.chunk}) runs before its B")
            if key in weights:
                raise ValueError(f"W of micro batch {step.microbatch} (chunk {step.chunk}) runs twice")
            weights.add(key)
    if backwards - weights:
        chunk, microbatch = sorted(backwards - weights)[0]
        raise ValueError(f"W of micro batch {microbatch} (chunk {chunk}) never runs")
