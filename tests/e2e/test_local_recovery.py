"""A rank killed at iteration 4 (``--inject-fault dead@4:1``) under ``torchrun --max-restarts 1`` with a local
checkpoint every iteration and no persistent one yet: the restarted workers restore the local copies of iteration 3
from ``/dev/shm`` (they outlived the killed workers), lose no iteration, and end with the weights and optimizer
state of a straight run, bitwise (docs/checkpoints.md "Local checkpoints")."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from megatron_like.training.checkpoint_integrity import read_dcp_metadata
from megatron_like.training.dist_checkpointing import read_full_tensors
from tests.e2e.cli import ROOT, launch, logged_losses
from tests.e2e.test_fault import gpt_flags


def saved_tensors(root: str) -> dict[str, torch.Tensor]:
    """Every model and optimizer tensor of the latest torch_dist checkpoint under ``root``."""
    path = os.path.join(root, "iter_0000006")
    keys = [k for k in read_dcp_metadata(path).state_dict_metadata if k.startswith(("model.", "optimizer."))]
    return read_full_tensors(root, keys)


def test_a_killed_rank_resumes_from_local_copies_bitwise_without_losing_an_iteration(tmp_path):
    flags = gpt_flags(6) + ["--hidden-dropout", "0.1", "--global-batch-size", "4", "--save-interval", "100",
                            "--num-workers", "0"]
    straight = str(tmp_path / "straight")
    reference = launch(2, flags + ["--save", straight])
    save = str(tmp_path / "recovered")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "--max-restarts", "1", "pretrain_gpt.py", *flags, "--save", save, "--load", save,
               "--local-checkpoint-interval", "1", "--inject-fault", "dead@4:1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = run.stdout
    assert run.returncode == 0, out[-3000:] + run.stderr[-3000:]
    assert " > injected fault: rank 1 dies at iteration 4" in out
    after_restart = out.split(" > restored the local checkpoints of iteration 3 (--local-checkpoint-interval)")
    assert len(after_restart) == 2, out[-3000:]
    assert "loaded checkpoint" not in out  # nothing read from the file system
    assert sorted(logged_losses(after_restart[1])) == [4, 5, 6]
    assert logged_losses(after_restart[1]) == {i: v for i, v in logged_losses(reference).items() if i >= 4}
    expected, got = saved_tensors(straight), saved_tensors(save)
    assert expected.keys() == got.keys()
    for key, value in expected.items():
        assert torch.equal(got[key], value), key
