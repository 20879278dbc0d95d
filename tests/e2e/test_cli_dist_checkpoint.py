"""pretrain_gpt.py: a torch_dist checkpoint saved on 4 processes (tp2 x pp2, ZeRO-1) continues on 2 (dp2, ZeRO-3
with CPU offload), logging the losses the uninterrupted 4-process run logged."""

from __future__ import annotations

import pytest

from megatron_like.training.checkpointing import write_tracker
from tests.e2e.cli import ISSUE_FLAGS, launch, logged_losses


def test_cli_torch_dist_checkpoint_continues_on_fewer_processes(tmp_path):
    save = str(tmp_path / "ckpt")
    straight = logged_losses(launch(4, ISSUE_FLAGS + [
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--zero-stage", "1",
        "--ckpt-format", "torch_dist", "--save", save, "--save-interval", "3"]))
    write_tracker(save, 3)  # the run also saved its last iteration, 6: continue from 3
    out = launch(2, ISSUE_FLAGS + ["--zero-stage", "3", "--optimizer-cpu-offload", "--load", save])
    assert f" > loaded checkpoint from {save} at iteration 3" in out
    resumed = logged_losses(out)
    assert sorted(resumed) == [4, 5, 6]
    for iteration, loss in resumed.items():
        assert loss == pytest.approx(straight[iteration], rel=1e-5), f"iteration {iteration}"
