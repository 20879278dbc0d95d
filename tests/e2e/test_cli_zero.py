"""pretrain_gpt.py on 2 ranks (as torchrun starts them) with data parallelism and ZeRO logs the single-process
losses (the CLI face of issue 4)."""

from __future__ import annotations

import pytest

from tests.e2e.cli import ISSUE_FLAGS, launch, logged_losses
from tests.e2e.test_cli_tensor_parallel import single_process_losses


@pytest.mark.parametrize(
    "flags",
    [["--zero-stage", "1"],
     ["--zero-stage", "2", "--optimizer-cpu-offload", "--overlap-grad-reduce"],
     ["--zero-stage", "3", "--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "1"]],
    ids=["zero1", "zero2-offload-overlap", "zero3-recompute"],
)
def test_cli_zero_logs_same_losses(flags):
    losses = logged_losses(launch(2, ISSUE_FLAGS + flags))
    expected = single_process_losses()
    assert sorted(losses) == sorted(expected)
    for iteration, loss in expected.items():
        assert losses[iteration] == pytest.approx(loss, rel=1e-4), f"iteration {iteration}"
