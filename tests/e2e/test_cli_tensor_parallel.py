"""The foundation issue's CLI check: pretrain_gpt.py on 2 and 4 ranks with tp (and sequence parallel) logs the
1-process losses (ranks as torchrun starts them: tests/e2e/cli.py's launch)."""

from __future__ import annotations

import functools

import pytest

from tests.e2e.cli import ISSUE_FLAGS, in_process_losses, launch, logged_losses


@functools.cache
def single_process_losses() -> dict[int, float]:
    return in_process_losses(ISSUE_FLAGS)


def test_single_process_loss_falls():
    losses = single_process_losses()
    assert sorted(losses) == list(range(1, 7))
    assert losses[6] < losses[1] - 0.05


@pytest.mark.parametrize(
    "nproc,flags",
    [
        (2, ["--tensor-model-parallel-size", "2"]),
        (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
        (4, ["--tensor-model-parallel-size", "4"]),
    ],
    ids=["tp2", "tp2-sp", "tp4"],
)
def test_cli_tensor_parallel_logs_same_losses(nproc, flags):
    output = launch(nproc, ISSUE_FLAGS + flags)
    expected = single_process_losses()
    losses = logged_losses(output)
    assert sorted(losses) == sorted(expected)
    for iteration, loss in expected.items():
        assert losses[iteration] == pytest.approx(loss, rel=1e-4), f"iteration {iteration}"
    assert f"number of parameters on (tensor, pipeline) model parallel rank ({nproc - 1}, 0)" in output
    assert "validation loss at the end of training for test data" in output
