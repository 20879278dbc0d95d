"""The pipeline issue's CLI check: pretrain_gpt.py on 4 ranks and pipeline parallelism (1F1B with tp=2,
pp=4, interleaved) logs the lm loss of one process at every iteration."""

from __future__ import annotations

import functools

import pytest

from tests.e2e.cli import in_process_losses, launch, logged_losses

# The command of the "Done when", without the launcher and the layout flags; one evaluation batch (not
# the default 100) after training, as in cli.ISSUE_FLAGS.
PIPELINE_FLAGS = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
    "--max-position-embeddings", "32", "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "6",
    "--lr", "1e-3", "--mock-data", "--vocab-size", "512", "--hidden-dropout", "0", "--attention-dropout", "0",
    "--log-interval", "1", "--seed", "1234", "--eval-iters", "1",
]


@functools.cache
def single_process_losses() -> dict[int, float]:
    return in_process_losses(PIPELINE_FLAGS)


@pytest.mark.parametrize(
    "layout",
    [
        ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
        ["--pipeline-model-parallel-size", "4"],
        ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
         "--num-layers-per-virtual-pipeline-stage", "1"],
    ],
    ids=["tp2-pp2", "pp4", "tp2-pp2-interleaved"],
)
def test_cli_pipeline_logs_same_losses(layout):
    output = launch(4, PIPELINE_FLAGS + layout)
    expected = single_process_losses()
    assert sorted(expected) == list(range(1, 7))
    losses = logged_losses(output)
    assert sorted(losses) == sorted(expected)
    for iteration, loss in expected.items():
        assert losses[iteration] == pytest.approx(loss, rel=1e-4), f"iteration {iteration}"
    pp = int(layout[layout.index("--pipeline-model-parallel-size") + 1])
    assert f"model parallel rank (0, {pp - 1})" in output, "every stage reports its parameters"
    assert "validation loss at the end of training for test data" in output
