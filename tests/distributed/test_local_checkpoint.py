"""``--local-checkpoint-interval``: a run interrupted after iteration 3 (its newest persistent checkpoint: 2) resumes
from the local copies of iteration 3, bitwise as the straight run, when every rank's state survives: in its own
copy, or for a rank whose own copy is gone, in the copy its peer holds; and from the persistent checkpoint when a
rank's state survives nowhere (docs/checkpoints.md "Local checkpoints"). The restart under torchrun, where the
copies outlive killed workers, is tested in tests/e2e/test_local_recovery.py."""

from __future__ import annotations

import os
import shutil

import torch

from megatron_like import collectives as comm
from megatron_like.config import parse_config
from megatron_like.training import loop
from megatron_like.training.checkpointing import write_tracker
from megatron_like.training.local_checkpoint import local_directory
from tests.distributed.gpt_runs import BASE_FLAGS, train_gpt
from tests.distributed.harness import run_distributed

FLAGS = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--global-batch-size", "4",
         "--hidden-dropout", "0.1", "--train-iters", "6", "--lr-decay-iters", "6", "--lr-warmup-iters", "1"]
LOST = {  # the copies that did not survive the failure (rank 1's own copy; the copy rank 0 holds of rank 1)
    "nothing": [],
    "rank 1's own copy": ["slot1-own-rank1-iter3.pt"],
    "every copy of rank 1": ["slot1-own-rank1-iter3.pt", "slot0-held-rank1-iter3.pt"],
}


def interrupted_then_resumed(rank: int, world_size: int, root: str) -> dict:
    restored_at = []
    restore = loop.restore_local_checkpoint

    def recording_restore(*args: object) -> tuple[int, int] | None:
        restored = restore(*args)
        restored_at.append(None if restored is None else restored[0])
        return restored

    loop.restore_local_checkpoint = recording_restore
    out = {"straight": train_gpt(rank, world_size, FLAGS)}
    for case, lost in LOST.items():
        save = os.path.join(root, case.replace(" ", "_").replace("'", ""))
        local = ["--save", save, "--local-checkpoint-interval", "1"]
        copies = local_directory(parse_config(BASE_FLAGS + FLAGS + local, world_size=world_size))
        train_gpt(rank, world_size, FLAGS + local + ["--save-interval", "2", "--exit-interval", "3"])
        comm.barrier()
        if rank == 0:  # killed after iteration 3 and before its persistent save: the tracker names 2
            shutil.rmtree(os.path.join(save, "iter_0000003"))
            write_tracker(save, 2)
            for name in lost:
                os.remove(os.path.join(copies, name))
        comm.barrier()
        out[case] = train_gpt(rank, world_size, FLAGS + local + ["--load", save])
        out[case]["restored_at"] = restored_at[-1]
        comm.barrier()  # both ranks have deleted their copies
        out[case]["copies_left"] = os.path.exists(copies)
    return out


def test_local_copies_restore_bitwise_and_fall_back_to_the_persistent_checkpoint(tmp_path):
    results = run_distributed(interrupted_then_resumed, 2, str(tmp_path), timeout=240)
    for result in results:
        straight = result["straight"]
        for case, restored_at in (("nothing", 3), ("rank 1's own copy", 3), ("every copy of rank 1", None)):
            resumed = result[case]
            assert resumed["restored_at"] == restored_at, case
            first = 3 if restored_at else 2  # iterations the resumed run did not train
            assert resumed["losses"] == straight["losses"][first:], case
            for name, value in straight["params"].items():
                assert torch.equal(resumed["params"][name], value), f"{case}: {name}"
            assert not resumed["copies_left"], f"{case}: the finished run left its copies in /dev/shm"
