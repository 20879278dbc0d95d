"""GPT trained through pretrain() with pipeline parallelism (1F1B and interleaved, with TP, SP and DP)
equals the single-process run; the recorded schedule traces show the 1F1B order and its memory bound.

To keep the suite fast, each process group runs several layouts one after the other (a bundle): two
processes run pp=2 and pp=2 with 2 virtual stages, four processes run the rest (with tp, sequence
parallelism, dp, and the distributed optimizer with overlapped gradient reduction). Every run trains three
steps and evaluates once (the forward-only schedule) on an 8-layer model.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest

from megatron_like.pipeline_parallel import record_schedule
from megatron_like.pipeline_parallel.trace import TraceEvent, max_in_flight
from tests.distributed.gpt_runs import BASE_FLAGS, TRAIN_ITERS, assert_same_training, full_parameters, merge_ranks
from tests.distributed.harness import run_distributed
from tests.distributed.megatron_order import megatron_order

COMMON = ["--num-layers", "8", "--eval-interval", "3", "--eval-iters", "1"]
PP, VP, TP, SP = "--pipeline-model-parallel-size", "--num-layers-per-virtual-pipeline-stage", \
    "--tensor-model-parallel-size", "--sequence-parallel"
BUNDLES = {
    2: {
        "pp2": [PP, "2"],
        "pp2-vp2": [PP, "2", VP, "2"],
    },
    4: {
        "pp4": [PP, "4"],
        "pp4-vp2": [PP, "4", VP, "1"],
        "tp2-pp2": [TP, "2", PP, "2"],
        "tp2-pp2-sp": [TP, "2", PP, "2", SP],
        "dp2-pp2": [PP, "2"],
        "tp2-pp2-vp2-sp": [TP, "2", PP, "2", VP, "2", SP],
        # gradient hooks of the overlapped, sharded data-parallel reduction fire inside the interleaved backward
        "dp2-pp2-vp2-zero1-overlap": [PP, "2", VP, "2", "--use-distributed-optimizer", "--overlap-grad-reduce"],
    },
}
CASES = [(world_size, name) for world_size, bundle in BUNDLES.items() for name in bundle]


def train_and_trace(rank: int, world_size: int, flags: list[str]) -> dict:
    """pretrain() with ``BASE_FLAGS + COMMON + flags``: losses, full parameters and the schedule trace."""
    import pretrain_gpt
    from megatron_like.config import parse_config
    from megatron_like.parallel_state import ParallelState
    from megatron_like.training import pretrain

    config = parse_config(BASE_FLAGS + COMMON + flags, world_size=world_size)
    ps = ParallelState.initialize(config.parallel, world_size)
    vocab = config.padded_vocab_size(config.model.vocab_size)
    provider = functools.partial(pretrain_gpt.model_provider, padded_vocab_size=vocab)
    with record_schedule() as trace:
        result = pretrain(config, provider, pretrain_gpt.forward_step, pretrain_gpt.datasets_provider, ps=ps,
                          padded_vocab_size=vocab)
    return {
        "losses": result.losses, "grad_norms": result.grad_norms, "validation_losses": result.validation_losses,
        "params": full_parameters(result.model, ps), "coords": (ps.tp_rank, ps.dp_rank, ps.pp_rank),
        "sizes": (ps.tp_size, ps.dp_size, ps.pp_size, config.virtual_pipeline_size, config.num_microbatches),
        "trace": [dataclasses.astuple(e) for e in trace.events],
    }


def run_bundle(rank: int, world_size: int, bundle: dict[str, list[str]]) -> dict[str, dict]:
    """Every layout of ``bundle`` in turn on the same processes (new process groups for each)."""
    return {name: train_and_trace(rank, world_size, flags) for name, flags in bundle.items()}


@functools.cache
def reference() -> dict:
    result = train_and_trace(0, 1, [])
    return {**merge_ranks([result]), "validation_losses": result["validation_losses"]}


@functools.cache
def bundle_results(world_size: int) -> dict[str, list[dict]]:
    """``{layout: [result of rank 0, rank 1, ...]}`` of one spawned process group."""
    per_rank = run_distributed(run_bundle, world_size, BUNDLES[world_size], timeout=600)
    return {name: [r[name] for r in per_rank] for name in BUNDLES[world_size]}


def events_of(result: dict) -> list[TraceEvent]:
    return [TraceEvent(*e) for e in result["trace"]]


def runs_of(result: dict) -> list[list[TraceEvent]]:
    """The events of each schedule call of one rank (3 training steps and the evaluations)."""
    events = events_of(result)
    return [[e for e in events if e.run == run] for run in sorted({e.run for e in events})]


def pipeline_of(results: list[dict]) -> list[dict]:
    """The ranks of the pipeline at tp = dp = 0, by stage."""
    return sorted((r for r in results if r["coords"][:2] == (0, 0)), key=lambda r: r["coords"][2])


@pytest.mark.parametrize("world_size,name", CASES, ids=[name for _, name in CASES])
def test_pipeline_training_equals_single_process(world_size, name):
    results = bundle_results(world_size)[name]
    expected = reference()
    assert_same_training(expected, merge_ranks(results))
    last_stage = [r for r in results if r["losses"]]
    assert {r["coords"][2] for r in last_stage} == {results[0]["sizes"][2] - 1}, "only the last stage has losses"
    for r in last_stage:
        assert r["validation_losses"] == pytest.approx(expected["validation_losses"], rel=1e-5)


@pytest.mark.parametrize("world_size,name", CASES, ids=[name for _, name in CASES])
def test_trace_follows_the_schedule_and_its_memory_bound(world_size, name):
    for result in bundle_results(world_size)[name]:
        _, _, pp, vp, m = result["sizes"]
        rank = result["coords"][2]
        runs = runs_of(result)
        training = [run for run in runs if any(e.kind == "B" for e in run)]
        evaluation = [run for run in runs if all(e.kind == "F" for e in run)]
        assert len(training) == TRAIN_ITERS and evaluation, "every training step and the evaluations"
        for run in training:
            steps = [e.step for e in run]
            # The order actually run equals Megatron-LM's, restated independently of schedules.py.
            assert [tuple(s) for s in steps] == megatron_order(pp, rank, m, vp)
            if vp == 1:
                # 1F1B: pp - rank - 1 warmup forwards, then strictly alternating F and B
                warmup = min(pp - rank - 1, m)
                assert [s.kind for s in steps[:warmup]] == ["F"] * warmup
                assert "".join(s.kind for s in steps[warmup:2 * m - warmup]) == "FB" * (m - warmup)
                assert max_in_flight(steps) == min(pp - rank, m)
            else:
                assert max_in_flight(steps) <= min(2 * (pp - rank - 1) + (vp - 1) * pp + 1, m * vp)
        for run in evaluation:
            assert [tuple(e.step) for e in run] == megatron_order(pp, rank, m, vp, forward_only=True)


@pytest.mark.parametrize("world_size,name", CASES, ids=[name for _, name in CASES])
def test_trace_times_respect_stage_dependencies(world_size, name):
    """A micro batch's forward on virtual stage s + 1 starts after it was computed on stage s (a step's
    event ends after it handed its result on: ``comm`` seconds later); backward reversed."""
    pipeline = pipeline_of(bundle_results(world_size)[name])
    pp = len(pipeline)
    for run in range(len(runs_of(pipeline[0]))):
        done: dict[tuple[str, int, int], TraceEvent] = {}
        for stage_rank, result in enumerate(pipeline):
            for e in runs_of(result)[run]:
                done[(e.kind, e.chunk * pp + stage_rank, e.microbatch)] = e
        for (kind, stage, microbatch), event in done.items():
            before = (kind, stage - 1 if kind == "F" else stage + 1, microbatch)
            if before in done:
                computed = done[before].end - done[before].comm
                assert computed <= event.start, f"{event} started before {done[before]} was computed"
