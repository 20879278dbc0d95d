"""``--ckpt-format torch_dist`` loads at another layout and training continues as if never interrupted.

One group of 4 processes, both directions between
  A = tp2 x pp2 with 2 virtual stages per rank, ZeRO-1 over dp 1, and
  B = tp1 x pp2 x dp2, ZeRO-3 with the optimizer offloaded to the CPU:
a straight run of 6 iterations at the saving layout also saves at iteration 3; a second run at the other
layout loads that checkpoint (weights, fp32 masters, Adam moments and step, lr schedule, data position)
and trains iterations 4-6. Its losses, grad norms and final weights must equal the straight run's within
float32 tolerance (the two layouts compute the same model, see test_zero.py and test_pipeline_parallel.py).

--async-save (bf16, ZeRO-2 over dp 2): the checkpoint written in the background holds the state of the
iteration it was taken at and resumes bitwise (dropout on, fp32 masters included); the run ends only
once its last checkpoint is named by the tracker.
"""

from __future__ import annotations

import os
import time

from megatron_like import collectives as comm
from megatron_like.training.checkpointing import write_tracker
from tests.distributed.gpt_runs import assert_same_training, merge_ranks, train_gpt
from tests.distributed.harness import run_distributed

A = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--zero-stage", "1",
     "--num-layers-per-virtual-pipeline-stage", "1"]
B = ["--pipeline-model-parallel-size", "2", "--zero-stage", "3", "--optimizer-cpu-offload"]
FLAGS = ["--ckpt-format", "torch_dist", "--train-iters", "6", "--lr-warmup-iters", "2",
         "--lr-decay-style", "cosine"]


def straight_then_other_layout(rank: int, world_size: int, root: str) -> dict:
    out = {}
    for name, saving, loading in (("A_to_B", A, B), ("B_to_A", B, A)):
        directory = os.path.join(root, name)
        straight = train_gpt(rank, world_size, FLAGS + saving + ["--save", directory, "--save-interval", "3"])
        if rank == 0:  # the straight run also saved iteration 6: resume from 3
            write_tracker(directory, 3)
        comm.barrier()
        resumed = train_gpt(rank, world_size, FLAGS + loading + ["--load", directory])
        out[name] = {"straight": straight, "resumed": resumed}
    return out


def test_torch_dist_checkpoint_continues_at_another_layout(tmp_path):
    results = run_distributed(straight_then_other_layout, 4, str(tmp_path))
    for name in ("A_to_B", "B_to_A"):
        straight = merge_ranks([r[name]["straight"] for r in results])
        resumed = merge_ranks([r[name]["resumed"] for r in results])
        assert len(straight["losses"]) == 6 and len(resumed["losses"]) == 3, name
        straight["losses"], straight["grad_norms"] = straight["losses"][3:], straight["grad_norms"][3:]
        assert_same_training(straight, resumed)


def async_save_then_resume(rank: int, world_size: int, root: str) -> dict:
    from megatron_like.training import dist_checkpointing
    from megatron_like.training.checkpointing import latest_iteration
    from tests.distributed.test_checkpoint_resume import RESUME_FLAGS

    # The writer starts only after training moved on (iterations take ~0.1 s here): what it writes must be
    # the host copy taken at the save, not the tensors training has changed since.
    dist_checkpointing.before_async_write = lambda: time.sleep(1.0)
    # bf16: the separate fp32 masters are saved and loaded too.
    flags = RESUME_FLAGS + ["--zero-stage", "2", "--bf16", "--ckpt-format", "torch_dist", "--async-save",
                            "--train-iters", "6"]
    straight = train_gpt(rank, world_size, flags + ["--save", root, "--save-interval", "3"])
    finished_at = latest_iteration(root)  # the end of training waited for the last write
    comm.barrier()
    if rank == 0:
        write_tracker(root, 3)
    comm.barrier()
    resumed = train_gpt(rank, world_size, flags + ["--load", root])
    return {"straight": straight["losses"], "resumed": resumed["losses"], "finished_at": finished_at}


def test_async_save_writes_the_state_of_its_iteration_and_resumes_bitwise(tmp_path):
    for r in run_distributed(async_save_then_resume, 2, str(tmp_path)):
        assert r["finished_at"] == 6
        assert len(r["straight"]) == 6 and r["resumed"] == r["straight"][3:]
