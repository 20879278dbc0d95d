"""Data parallelism with ZeRO 0-3, overlapped reduction and CPU offload, alone and with tp, pp and vp,
trained through pretrain(): losses, grad norms and updated weights equal the single-process run (fp32,
the float32 tolerance of ``assert_same_training``). Also: per-rank state bytes follow ZeRO's table.

Every configuration of one world size, and the memory runs, run in one spawned process group: spawning costs
more than a run of this model.
"""

from __future__ import annotations

import functools

import pytest

from tests.distributed.gpt_runs import assert_same_training, merge_ranks, train_gpt, train_gpt_many
from tests.distributed.harness import run_distributed

TP2 = ["--tensor-model-parallel-size", "2"]
PP2 = ["--pipeline-model-parallel-size", "2"]
OVERLAP = ["--overlap-grad-reduce"]
OFFLOAD = ["--optimizer-cpu-offload"]
PARAM_GATHER = ["--overlap-param-gather"]  # ZeRO-3 prefetch; ZeRO-1/2 gather of updated params behind forward


def zero(stage: int) -> list[str]:
    return ["--zero-stage", str(stage)]


CASES: dict[int, dict[str, list[str]]] = {
    2: {
        "dp2-zero0": zero(0),
        "dp2-zero1": zero(1),
        "dp2-zero2": zero(2),
        "dp2-zero3": zero(3),
        "dp2-zero0-overlap": zero(0) + OVERLAP,
        "dp2-zero1-overlap": zero(1) + OVERLAP,
        "dp2-zero2-overlap": zero(2) + OVERLAP,
        "dp2-zero3-overlap": zero(3) + OVERLAP,
        "dp2-distributed-optimizer": ["--use-distributed-optimizer"],
        "dp2-zero0-offload": zero(0) + OFFLOAD,
        "dp2-zero1-offload-overlap": zero(1) + OFFLOAD + OVERLAP,
        "dp2-zero3-offload": zero(3) + OFFLOAD,
        "dp2-zero3-recompute-uniform": zero(3) + ["--recompute-granularity", "full", "--recompute-method",
                                                  "uniform", "--recompute-num-layers", "2"],
        "dp2-zero2-recompute-selective": zero(2) + OVERLAP + ["--recompute-granularity", "selective"],
        "dp2-zero1-overlap-param-gather": zero(1) + OVERLAP + PARAM_GATHER,
        "dp2-zero2-overlap-param-gather": zero(2) + PARAM_GATHER,
        "dp2-zero3-prefetch": zero(3) + PARAM_GATHER,
        "dp2-zero3-prefetch-overlap": zero(3) + OVERLAP + PARAM_GATHER,
        "dp2-zero3-prefetch-recompute-uniform": zero(3) + PARAM_GATHER + [
            "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2"],
    },
    4: {
        "tp2-dp2-zero1": TP2 + zero(1),
        "tp2-sp-dp2-zero2": TP2 + ["--sequence-parallel"] + zero(2),
        "tp2-sp-dp2-zero3-overlap": TP2 + ["--sequence-parallel"] + zero(3) + OVERLAP,
        "tp2-dp2-zero3-offload": TP2 + zero(3) + OFFLOAD,
        "dp4-zero1-offload": zero(1) + OFFLOAD,
        "dp4-zero2-overlap": zero(2) + OVERLAP,
        "dp4-zero3": zero(3),
        "pp2-dp2-zero1": PP2 + zero(1),
        "pp2-dp2-zero2-overlap": PP2 + zero(2) + OVERLAP,
        "pp2-dp2-zero3": PP2 + zero(3),
        "pp2-dp2-zero3-offload-overlap": PP2 + zero(3) + OFFLOAD + OVERLAP,
        "pp2-vp2-dp2-zero3": PP2 + ["--num-layers-per-virtual-pipeline-stage", "1"] + zero(3),
        "pp2-vp2-dp2-zero3-prefetch": PP2 + ["--num-layers-per-virtual-pipeline-stage", "1"] + zero(3)
        + OVERLAP + PARAM_GATHER,
        "pp2-dp2-zero1-overlap-param-gather": PP2 + zero(1) + OVERLAP + PARAM_GATHER,
    },
}


@functools.cache
def reference() -> dict:
    """The single-process fp32 run every case is compared with."""
    return merge_ranks([train_gpt(0, 1, [])])


def cases_and_memory(rank: int, world_size: int, flag_lists: list[list[str]]) -> tuple[list[dict], list[dict]]:
    """``train_gpt_many`` of the cases, then ``memory_worker``: every run of one world size in one process group."""
    return train_gpt_many(rank, world_size, flag_lists), memory_worker(rank, world_size)


@functools.cache
def spawned(world_size: int) -> tuple[dict[str, dict], list[list[dict]]]:
    """Every case of ``world_size`` processes (merged results by name) and each rank's ``memory_worker`` result."""
    names = list(CASES[world_size])
    per_rank = run_distributed(cases_and_memory, world_size, [CASES[world_size][n] for n in names], timeout=600)
    merged = {name: merge_ranks([cases[i] for cases, _ in per_rank]) for i, name in enumerate(names)}
    return merged, [memory for _, memory in per_rank]


def runs(world_size: int) -> dict[str, dict]:
    return spawned(world_size)[0]


@pytest.mark.parametrize("world_size,name", [(w, n) for w, cases in CASES.items() for n in cases])
def test_zero_training_equals_single_process(world_size: int, name: str) -> None:
    assert_same_training(reference(), runs(world_size)[name])


@pytest.mark.parametrize("world_size,name", [(w, n) for w, cases in CASES.items() for n in cases])
def test_every_data_parallel_replica_holds_the_same_weights(world_size: int, name: str) -> None:
    """Not only rank 0's weights: after training, every rank holding a parameter holds it bitwise equal
    (a rank that skipped an update or missed the gather of updated shards would differ)."""
    run = runs(world_size)[name]
    flags = CASES[world_size][name]
    pp = int(flags[flags.index("--pipeline-model-parallel-size") + 1]) if "--pipeline-model-parallel-size" in flags \
        else 1
    holders = world_size // pp  # dp replicas x tp ranks (after the gather) of each stage
    assert set(run["copies"].values()) == {holders}, run["copies"]
    assert run["replica_mismatches"] == []


# ------------------------------------------------------------------------------------------ memory
MEMORY_FLAGS = ["--bf16", "--train-iters", "1"]


def memory_worker(rank: int, world_size: int) -> list[dict]:
    """bf16 runs at ZeRO 0-3: this rank's measured and theoretical state bytes, and freed ZeRO-3 params."""
    import pretrain_gpt
    from megatron_like.config import parse_config
    from megatron_like.distributed.memory import measured_state_bytes, theoretical_state_bytes
    from megatron_like.parallel_state import ParallelState
    from megatron_like.training import pretrain
    from tests.distributed.gpt_runs import BASE_FLAGS

    out = []
    for stage in range(4):
        config = parse_config(BASE_FLAGS + MEMORY_FLAGS + zero(stage), world_size=world_size)
        ps = ParallelState.initialize(config.parallel, world_size)
        vocab = config.padded_vocab_size(config.model.vocab_size)
        provider = functools.partial(pretrain_gpt.model_provider, padded_vocab_size=vocab)
        result = pretrain(config, provider, pretrain_gpt.forward_step, pretrain_gpt.datasets_provider, ps=ps,
                          padded_vocab_size=vocab)
        num_params = sum(p.numel() for chunk in result.model for p in chunk.parameters())
        measured = measured_state_bytes(result.optimizer.data_parallel, result.optimizer)
        theory = theoretical_state_bytes(num_params, ps.dp_size, stage, param_bytes=2, separate_master=True)
        resident = sum(p.untyped_storage().nbytes() for chunk in result.model for p in chunk.parameters())
        out.append({"measured": vars(measured), "theory": vars(theory), "resident_param_storage": resident,
                    "num_params": num_params})
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_state_bytes_shrink_by_dp_as_zero_predicts(world_size: int) -> None:
    for rank_results in spawned(world_size)[1]:
        phi = rank_results[0]["num_params"]
        for stage, r in enumerate(rank_results):
            for kind in ("params", "grads", "optimizer"):
                measured, theory = r["measured"][kind], r["theory"][kind]
                assert abs(measured - theory) <= 0.05 * theory, (stage, kind, measured, theory)
            # The table itself, spelled out: Φ bf16 params, fp32 grads, 12-byte optimizer state.
            dp = world_size
            expected = {
                "params": 2 * phi / (dp if stage >= 3 else 1),
                "grads": 4 * phi / (dp if stage >= 2 else 1),
                "optimizer": 12 * phi / (dp if stage >= 1 else 1),
            }
            for kind, value in expected.items():
                assert abs(r["measured"][kind] - value) <= 0.05 * value, (stage, kind)
        # Between steps ZeRO-3 parameters hold no memory (all views of freed gather buffers).
        assert rank_results[3]["resident_param_storage"] == 0
        assert rank_results[0]["resident_param_storage"] > 0
