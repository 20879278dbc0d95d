"""The whole GPT trained through pretrain() with tensor (and sequence) parallelism equals one process.

Every layout of one world size runs in one spawned process group (``train_gpt_many``).
"""

from __future__ import annotations

import functools

import pytest

from tests.distributed.gpt_runs import assert_same_training, merge_ranks, train_gpt, train_gpt_many
from tests.distributed.harness import run_distributed

UNTIED = ["--untie-embeddings-and-output-weights", "--train-iters", "3"]
CASES: dict[str, tuple[int, list[str]]] = {  # name: (world size, flags)
    "tp2": (2, ["--tensor-model-parallel-size", "2"]),
    "tp2-sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "tp4": (4, ["--tensor-model-parallel-size", "4"]),
    "tp4-sp": (4, ["--tensor-model-parallel-size", "4", "--sequence-parallel"]),
    "dp2": (2, ["--tensor-model-parallel-size", "1"]),  # data parallel dp=2
    "tp2-sp-dp2": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),  # tp=2 x dp=2
    "untied-tp2": (2, UNTIED + ["--tensor-model-parallel-size", "2"]),
}


@functools.cache
def reference(extra: tuple[str, ...] = ()) -> dict:
    """The single-process run (computed once per flag set and shared by the tests)."""
    return merge_ranks([train_gpt(0, 1, list(extra))])


@functools.cache
def runs(world_size: int) -> dict[str, dict]:
    """Every case of ``world_size`` processes, run in one process group; merged results by name."""
    names = [name for name, (size, _) in CASES.items() if size == world_size]
    per_rank = run_distributed(train_gpt_many, world_size, [CASES[name][1] for name in names])
    return {name: merge_ranks([rank_results[i] for rank_results in per_rank]) for i, name in enumerate(names)}


@pytest.mark.parametrize("name", [name for name in CASES if not name.startswith("untied")])
def test_parallel_training_equals_single_process(name):
    assert_same_training(reference(), runs(CASES[name][0])[name])


def test_loss_falls_and_untied_output_layer_matches():
    single = reference(tuple(UNTIED))
    assert "output_layer.weight" in single["params"]
    assert_same_training(single, runs(2)["untied-tp2"])
    assert reference()["losses"][-1] < reference()["losses"][0]
