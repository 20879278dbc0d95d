"""Context parallelism through the command line: the Llama-style tiny model of test_cli_llama trained on 2 ranks
(as torchrun starts them) with ``--context-parallel-size 2`` and ZeRO-1 (its optimizer shards over the dp x cp
ranks) logs the single process's losses, and its torch_dist checkpoint continues in one process (cp 1) and at cp 4
with the losses of the uninterrupted run.

Packed documents (``--reset-attention-mask --reset-position-ids --eod-mask-loss`` on test_cli_packed_documents'
indexed dataset of short documents) at cp 2, ring and all-to-all, log the loss of the documents run one by one:
documents cut by the chunk boundaries stay apart across ranks, and the loss is the mean over the whole sequence's
unmasked tokens (their count differs between the cp ranks).

The losses are held to 3e-6, a few units of the log's last digit (1e-6): at initialisation this model's loss is
nearly that of a uniform guess, and rotary positions of the wrong tokens move it by about 1e-5 only."""

from __future__ import annotations

import pytest

from tests.e2e import test_cli_packed_documents as packed
from tests.e2e.cli import launch, logged_losses
from tests.e2e.test_cli_llama import LLAMA_FLAGS, single_process_losses

CP2 = ["--context-parallel-size", "2", "--cp-comm-type", "p2p", "--zero-stage", "1"]


def assert_single_process_losses(losses: dict[int, float], iterations: range) -> None:
    expected = single_process_losses()
    assert sorted(losses) == list(iterations)
    for iteration in iterations:
        assert losses[iteration] == pytest.approx(expected[iteration], rel=0, abs=3e-6), f"iteration {iteration}"


def test_cp2_logs_single_process_losses_and_continues_at_cp1_and_cp4(tmp_path):
    source = tmp_path / "cp2"
    output = launch(2, LLAMA_FLAGS + CP2 + ["--train-iters", "3", "--save", str(source)])
    assert_single_process_losses(logged_losses(output), range(1, 4))
    resumed = launch(1, LLAMA_FLAGS + ["--load", str(source)])
    assert_single_process_losses(logged_losses(resumed), range(4, 7))
    at_cp4 = launch(4, LLAMA_FLAGS + ["--context-parallel-size", "4", "--load", str(source)])
    assert_single_process_losses(logged_losses(at_cp4), range(4, 7))


@pytest.mark.parametrize("comm_type", ["p2p", "a2a"])
def test_cp2_packed_documents_log_the_documents_run_one_by_one(tmp_path, comm_type):
    packed.write_documents(str(tmp_path / "docs"))
    flags = packed.FLAGS + packed.PACKED + ["--data-path", str(tmp_path / "docs"), "--data-cache-path",
                                            str(tmp_path / "cache")]
    output = launch(2, flags + ["--context-parallel-size", "2", "--cp-comm-type", comm_type])
    assert logged_losses(output)[1] == pytest.approx(packed.documents_one_by_one_loss(flags), rel=2e-5)
