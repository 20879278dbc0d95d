"""``--dropout-rng layout-independent`` (issue 32): with dropout on, pretrain_gpt.py and pretrain_vit.py at tp2 x pp2
log the losses of one process, so a tp x pp run is the one-process run for the same seed (model/dropout.py).

The GPT run adds sequence parallelism (the residual and embedding masks are cut from the whole sequence's) and full
recomputation (the re-run draws the masks of the first run) to the layout; its reference runs neither.
"""

from __future__ import annotations

import pytest

from tests.e2e.cli import in_process_losses, launch, logged_values

DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--dropout-rng", "layout-independent"]
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]
GPT_FLAGS = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--max-position-embeddings", "16", "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "3",
    "--lr", "1e-3", "--mock-data", "--vocab-size", "256", "--log-interval", "1", "--seed", "1234",
    "--eval-iters", "0",
]
VIT_FLAGS = [
    "--mock-data", "--image-size", "12", "--patch-size", "4", "--num-layers", "2", "--hidden-size", "32",
    "--num-attention-heads", "4", "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "3",
    "--lr", "1e-3", "--eval-iters", "0", "--log-interval", "1", "--num-workers", "0", "--seed", "1234",
]
VIT = "pretrain_vit.py"
TP2_PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]


def assert_same_losses(expected: dict[int, float], logged: dict[int, float]) -> None:
    assert sorted(logged) == sorted(expected) == list(range(1, 4))
    for iteration, loss in expected.items():
        assert logged[iteration] == pytest.approx(loss, rel=1e-5), f"iteration {iteration}"


def test_gpt_dropout_tp2_pp2_sp_recompute_logs_one_process_losses():
    expected = in_process_losses(GPT_FLAGS + DROPOUT)
    undropped = in_process_losses(GPT_FLAGS + NO_DROPOUT)
    assert all(abs(expected[i] - undropped[i]) > 1e-4 for i in expected), "dropout was off"
    output = launch(4, GPT_FLAGS + DROPOUT + TP2_PP2 + [
        "--sequence-parallel", "--recompute-granularity", "full", "--recompute-method", "uniform",
        "--recompute-num-layers", "1"])
    assert_same_losses(expected, logged_values(output, "lm loss"))


def test_vit_dropout_tp2_pp2_logs_one_process_losses():
    """pretrain_vit.py's default is layout-independent: its recipe at tp2 x pp2 is its one-process run."""
    expected = logged_values(launch(1, VIT_FLAGS, script=VIT), "loss")
    undropped = logged_values(launch(1, VIT_FLAGS + NO_DROPOUT, script=VIT), "loss")
    assert all(abs(expected[i] - undropped[i]) > 1e-4 for i in expected), "dropout was off"
    assert_same_losses(expected, logged_values(launch(4, VIT_FLAGS + TP2_PP2, script=VIT), "loss"))
