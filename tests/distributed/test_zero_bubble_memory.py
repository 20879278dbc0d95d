"""Peak activation memory per pipeline stage under 1F1B, ZB-H1, ZB-V and DualPipeV against the planner's bound.

Each rank of a 2-stage GPT whose activations dominate (benchmarks/pipeline_bubble.py's chunks: 4 layers, h 64,
s 128, b 4, 4 micro batches) measures the peak bytes of tensors allocated during one schedule call (the
profiler's allocation log, after a warm-up call, gradients already allocated) and compares it with what
``tools/plan.py`` predicts for that rank (``planning/activations.py``, ``planning/split_backward.py``): the whole
activations of the micro batches between F and B, the W stashes (deferred GEMMs' inputs and output gradients)
of those between B and W, at the peak of the rank's own order, plus the last stage's logits.
"""

from __future__ import annotations

import functools

import pytest

from tests.distributed.harness import run_distributed

SCHEDULES = ("1f1b", "zb-h1", "zb-v", "dualpipev")
LAYERS, HIDDEN, SEQ, MICRO_BATCH, MICROBATCHES = 4, 64, 128, 4, 4


def config_flags(schedule: str) -> list[str]:
    """The flags of pipeline_bubble.build_gpt_chunks' model, at pp 2 under ``schedule``."""
    return ["--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN), "--num-attention-heads", "8",
            "--seq-length", str(SEQ), "--micro-batch-size", str(MICRO_BATCH), "--mock-data", "--vocab-size", "1024",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--pipeline-model-parallel-size", "2",
            "--global-batch-size", str(MICRO_BATCH * MICROBATCHES), "--pipeline-schedule", schedule]


def peak_activation_bytes(rank: int, world_size: int) -> dict:
    """Per schedule, the peak bytes allocated during one training schedule call on this rank (gradients already
    allocated by a warm-up call, so what grows is activations, W stashes and the step's own temporaries); and
    under ``"trace"`` the (start, end, wait) of the warm-up calls' traced steps."""
    import sys
    from types import SimpleNamespace

    import torch

    from megatron_like.config import ParallelConfig
    from megatron_like.parallel_state import ParallelState
    from megatron_like.pipeline_parallel import ScheduleTrace, get_forward_backward_func
    from tests.peak_memory import peak_live_bytes

    sys.path.insert(0, "benchmarks")
    import pipeline_bubble

    # The V's process groups (the loss on rank 0) also serve the ring's bare schedule calls: these use only the
    # pipeline neighbours.
    ps = ParallelState.initialize(ParallelConfig(pipeline_model_parallel_size=world_size, pipeline_schedule="zb-v"),
                                  world_size)
    args = SimpleNamespace(gpt_layers=LAYERS, hidden_size=HIDDEN, seq_length=SEQ, micro_batch_size=MICRO_BATCH)
    peaks: dict = {"trace": []}
    for schedule in SCHEDULES:
        v_shape = schedule in ("zb-v", "dualpipev")
        chunks, forward_step, batches = pipeline_bubble.build_gpt_chunks(ps, 2 if v_shape else 1, args, v_shape)
        run = get_forward_backward_func(world_size, len(chunks), schedule)

        def step(trace: ScheduleTrace | None = None) -> None:
            run(forward_step, batches, chunks, MICROBATCHES, seq_length=SEQ, micro_batch_size=MICRO_BATCH,
                trace=trace)

        warmup = ScheduleTrace()
        step(warmup)
        peaks["trace"].append([(e.start, e.end, e.wait) for e in warmup.events])
        for chunk in chunks:
            chunk.zero_grad(set_to_none=False)
        peaks[schedule] = peak_live_bytes(step)[0]
    torch.distributed.barrier()
    return peaks


@functools.cache
def measured() -> list[dict[str, int]]:
    return run_distributed(peak_activation_bytes, 2, timeout=600)


def planned(schedule: str, pp_rank: int) -> float:
    from megatron_like.config import parse_config
    from megatron_like.planning.activations import activation_bytes

    return activation_bytes(parse_config(config_flags(schedule), world_size=2), pp_rank, 1024, device="cpu").total


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_measured_peak_per_stage_is_the_planned_bound(schedule):
    """Each stage's measured peak is within 10% of the planner's bound for its schedule."""
    for pp_rank, peaks in enumerate(measured()):
        bound = planned(schedule, pp_rank)
        assert peaks[schedule] == pytest.approx(bound, rel=0.10), \
            f"rank {pp_rank}: measured {peaks[schedule] / 2**20:.2f} MiB, planned {bound / 2**20:.2f} MiB"


def test_zb_h1_first_stage_peak_is_1f1bs():
    """ZB-H1 keeps 1F1B's order of forwards and backwards: its first stage, where no W waits at the peak, holds
    what 1F1B's does (the later stages add the W stashes the test above counts)."""
    first = measured()[0]
    assert first["zb-h1"] == pytest.approx(first["1f1b"], rel=0.10), first



def test_trace_records_each_steps_wait_for_its_input():
    """The executor records how long each step waited for its input (what pipeline_bubble.py tells apart from its
    own time between steps): within the gap since the rank's previous step, and the second stage's first step
    (its input is the first stage's first forward) did wait."""
    for pp_rank, result in enumerate(measured()):
        for events in result["trace"]:
            assert all(wait <= start - previous_end
                       for (_, previous_end, _), (start, _, wait) in zip(events, events[1:]))
            if pp_rank == 1:
                assert events[0][2] > 0.0
