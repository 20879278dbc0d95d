"""Resuming from a checkpoint continues exactly: 8 steps straight == 4 steps + save + load + 4 steps.

Layouts: tp2 x pp2, and ZeRO-2 over dp2 (every dp rank saves its own optimizer shard and RNG states),
also with the optimizer offloaded to the CPU (CPUAdam's moments and step counts); in the torch format
and in torch_dist (global tensors through torch.distributed.checkpoint, test_dist_checkpoint.py).
"""

from __future__ import annotations

import os
import tempfile

import pytest

from tests.distributed.gpt_runs import train_gpt
from tests.distributed.harness import run_distributed

# Dropout on, so the restored RNG states (default stream and the tp tracker) matter; the lr schedule
# spans 8 iterations in every run so the 4-iteration run decays the same way.
RESUME_FLAGS = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--lr-decay-iters", "8",
                "--lr-warmup-iters", "2", "--lr-decay-style", "cosine"]


def straight_and_resumed(rank: int, world_size: int, layout: list[str], root: str) -> dict:
    flags = RESUME_FLAGS + layout
    straight = train_gpt(rank, world_size, flags + ["--train-iters", "8"])
    first = train_gpt(rank, world_size, flags + ["--train-iters", "4", "--save", root])
    resumed = train_gpt(rank, world_size, flags + ["--train-iters", "8", "--load", root])
    return {"straight": straight["losses"], "first": first["losses"], "resumed": resumed["losses"],
            "has_loss": bool(straight["losses"])}


@pytest.mark.parametrize(
    "world_size,layout",
    [(4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
     (2, ["--zero-stage", "2"]),
     (2, ["--zero-stage", "2", "--optimizer-cpu-offload"]),
     (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--ckpt-format", "torch_dist"]),
     (2, ["--zero-stage", "2", "--optimizer-cpu-offload", "--ckpt-format", "torch_dist"])],
    ids=["tp2-pp2", "zero2-dp2", "zero2-dp2-offload", "tp2-pp2-torch_dist", "zero2-dp2-offload-torch_dist"],
)
def test_resume_gives_bitwise_equal_losses(world_size, layout):
    with tempfile.TemporaryDirectory() as root:
        results = run_distributed(straight_and_resumed, world_size, layout, root)
        assert os.path.exists(os.path.join(root, "latest_checkpointed_iteration.txt"))
    for r in (r for r in results if r["has_loss"]):
        assert len(r["straight"]) == 8 and len(r["first"]) == 4 and len(r["resumed"]) == 4
        assert r["first"] == r["straight"][:4]
        assert r["resumed"] == r["straight"][4:], "resumed run diverged from the straight run"
