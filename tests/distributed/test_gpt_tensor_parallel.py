"""The whole GPT trained through pretrain() with tensor (and sequence) parallelism equals one process."""

from __future__ import annotations

import functools

import pytest

from tests.distributed.gpt_runs import assert_same_training, merge_ranks, train_gpt
from tests.distributed.harness import run_distributed


@functools.cache
def reference(extra: tuple[str, ...] = ()) -> dict:
    """The single-process run (computed once per flag set and shared by the tests)."""
    return merge_ranks([train_gpt(0, 1, list(extra))])


@pytest.mark.parametrize(
    "world_size,flags",
    [
        (2, ["--tensor-model-parallel-size", "2"]),
        (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
        (4, ["--tensor-model-parallel-size", "4"]),
        (4, ["--tensor-model-parallel-size", "4", "--sequence-parallel"]),
        (2, ["--tensor-model-parallel-size", "1"]),  # data parallel dp=2
        (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),  # tp=2 x dp=2
    ],
    ids=["tp2", "tp2-sp", "tp4", "tp4-sp", "dp2", "tp2-sp-dp2"],
)
def test_parallel_training_equals_single_process(world_size, flags):
    parallel = merge_ranks(run_distributed(train_gpt, world_size, flags))
    assert_same_training(reference(), parallel)


def test_loss_falls_and_untied_output_layer_matches():
    flags = ("--untie-embeddings-and-output-weights", "--train-iters", "3")
    single = reference(flags)
    parallel = merge_ranks(run_distributed(train_gpt, 2, list(flags) + ["--tensor-model-parallel-size", "2"]))
    assert "output_layer.weight" in single["params"]
    assert_same_training(single, parallel)
    assert reference()["losses"][-1] < reference()["losses"][0]
