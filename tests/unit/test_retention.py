"""``--keep-last-checkpoints`` / ``--keep-checkpoint-every`` and the honest log of ``--async-save``
(docs/checkpoints.md "Retention")."""

from __future__ import annotations

import os

import pytest

from megatron_like.training import checkpointing
from megatron_like.training.checkpointing import CheckpointError, latest_iteration
from megatron_like.training.retention import saved_iterations, to_delete
from tests.distributed.gpt_runs import train_gpt

SMALL = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--global-batch-size", "2"]


def test_the_rule_keeps_the_newest_and_the_milestones_at_or_below_the_tracker():
    assert to_delete([1, 2, 3, 4, 5, 6, 7], tracked=6, keep_last=2, keep_every=3) == [1, 2, 4]
    assert to_delete([2, 4, 6], tracked=6, keep_last=5, keep_every=None) == []


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_old_checkpoints_go_only_once_the_tracker_names_a_newer_one(tmp_path, monkeypatch, ckpt_format):
    save = str(tmp_path)
    flags = SMALL + ["--ckpt-format", ckpt_format, "--save", save, "--save-interval", "1", "--lr-decay-iters", "6",
                     "--keep-last-checkpoints", "1", "--keep-checkpoint-every", "3"]
    train_gpt(0, 1, flags + ["--train-iters", "4"])
    assert saved_iterations(save) == [3, 4] and latest_iteration(save) == 4

    def tracker_fails(point: str) -> None:
        if point == "tracker":
            raise OSError(28, "No space left on device")

    # The save of iteration 5 writes its files, then cannot name them: iteration 4 must stay.
    monkeypatch.setattr(checkpointing, "fault_hook", tracker_fails)
    with pytest.raises(CheckpointError, match="iteration 5 failed on rank 0: OSError"):
        train_gpt(0, 1, flags + ["--train-iters", "6", "--load", save])
    assert latest_iteration(save) == 4 and 4 in saved_iterations(save)


def test_an_async_save_says_saved_only_once_the_tracker_names_it(tmp_path, monkeypatch, capsys):
    write_tracker = checkpointing.write_tracker

    def noisy_write_tracker(root: str, iteration: int) -> None:
        write_tracker(root, iteration)
        print(f"[tracker names {iteration}]", flush=True)

    monkeypatch.setattr(checkpointing, "write_tracker", noisy_write_tracker)
    save = str(tmp_path)
    train_gpt(0, 1, SMALL + ["--train-iters", "2", "--save", save, "--save-interval", "1", "--async-save"])
    lines = [line.strip() for line in capsys.readouterr().out.splitlines() if "checkpoint" in line or "[" in line]
    for iteration in (1, 2):
        started = lines.index(f"> started saving checkpoint at iteration {iteration} to {save} in the background")
        named = lines.index(f"[tracker names {iteration}]")
        saved = lines.index(f"> saved checkpoint at iteration {iteration} to {save}")
        assert started < named < saved, lines
    assert os.path.exists(os.path.join(save, "iter_0000002", "common.pt"))
