"""``--ckpt-format torch_dist`` loads at another layout and training continues as if never interrupted.

One group of 4 processes, both directions between
  A = tp2 x pp2, ZeRO-1 over dp 1, and
  B = tp1 x pp2 x dp2, ZeRO-3 with the optimizer offloaded to the CPU:
a straight run of 6 iterations at the saving layout also saves at iteration 3; a second run at the other
layout loads that checkpoint (weights, fp32 masters, Adam moments and step, lr schedule, data position)
and trains iterations 4-6. Its losses, grad norms and final weights must equal the straight run's within
float32 tolerance (the two layouts compute the same model, see test_zero.py and test_pipeline_parallel.py).
"""

from __future__ import annotations

import os

from megatron_like import collectives as comm
from megatron_like.training.checkpointing import write_tracker
from tests.distributed.gpt_runs import assert_same_training, merge_ranks, train_gpt
from tests.distributed.harness import run_distributed

A = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--zero-stage", "1"]
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
