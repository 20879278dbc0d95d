"""Context parallelism through the command line: the Llama-style tiny model of test_cli_llama trained on 2 ranks
(as torchrun starts them) with ``--context-parallel-size 2`` logs the single process's losses, and its torch_dist
checkpoint continues in one process (cp 1) with the losses of the uninterrupted run."""

from __future__ import annotations

from tests.e2e.cli import launch, logged_losses
from tests.e2e.test_cli_llama import LLAMA_FLAGS, assert_same_losses

CP2 = ["--context-parallel-size", "2", "--cp-comm-type", "p2p"]


def test_cp2_logs_single_process_losses_and_continues_at_cp1(tmp_path):
    source = tmp_path / "cp2"
    output = launch(2, LLAMA_FLAGS + CP2 + ["--train-iters", "3", "--save", str(source)])
    assert_same_losses(logged_losses(output), range(1, 4))
    resumed = launch(1, LLAMA_FLAGS + ["--load", str(source)])
    assert_same_losses(logged_losses(resumed), range(4, 7))
