"""Checkpoints on CUDA.

* A torch_dist checkpoint crosses devices and layouts: saved by one process on the GPU, it continues on two CPU
  processes at tensor-parallel size 2 (gloo), and the other way round, like the uninterrupted run of the saving
  side. float32 (no TF32: PyTorch's default for matmuls), so the GPU and the CPU compute the same model within
  float32 tolerance: the resumed iterations' losses and gradient norms, and the final weights, must equal the
  straight run's. A load that missed the weights or the Adam state would be off by a whole learning-rate step.
* With dropout on, a run resumed on the GPU draws the masks the uninterrupted run drew: the checkpoint carries
  the CUDA generator states (default and tensor-parallel tracker), which only a GPU run saves and restores.
"""

from __future__ import annotations

import os

import pytest

from megatron_like.training.checkpointing import write_tracker
from tests.distributed.gpt_runs import assert_same_training, merge_ranks, train_gpt
from tests.distributed.harness import run_distributed

FLAGS = ["--ckpt-format", "torch_dist", "--train-iters", "6", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine"]
TP2 = ["--tensor-model-parallel-size", "2"]


def train_on_cpu(rank: int, world_size: int, flags: list[str]) -> dict:
    """``train_gpt`` with CUDA hidden (set before this fresh process touches CUDA): CPU + gloo."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    return train_gpt(rank, world_size, flags)


def train(on_gpu: bool, flags: list[str]) -> dict:
    """Merged results of a run on one GPU process, or on two CPU processes at tp 2."""
    if on_gpu:
        return merge_ranks(run_distributed(train_gpt, 1, flags))
    return merge_ranks(run_distributed(train_on_cpu, 2, flags + TP2))


@pytest.mark.parametrize("saved_on_gpu", [True, False], ids=["gpu_tp1_to_cpu_tp2", "cpu_tp2_to_gpu_tp1"])
def test_torch_dist_checkpoint_continues_on_the_other_device_and_layout(tmp_path, saved_on_gpu):
    directory = str(tmp_path / "ckpt")
    straight = train(saved_on_gpu, FLAGS + ["--save", directory, "--save-interval", "3"])
    write_tracker(directory, 3)  # the straight run also saved iteration 6: continue from 3
    resumed = train(not saved_on_gpu, FLAGS + ["--load", directory])
    assert len(straight["losses"]) == 6 and len(resumed["losses"]) == 3
    straight["losses"], straight["grad_norms"] = straight["losses"][3:], straight["grad_norms"][3:]
    assert_same_training(straight, resumed, rtol=1e-4, weight_atol=1e-4)


def test_resume_on_gpu_restores_the_cuda_generators(tmp_path):
    directory = str(tmp_path / "ckpt")
    dropout = ["--hidden-dropout", "0.2", "--attention-dropout", "0.2"]
    straight = train(True, FLAGS + dropout + ["--save", directory, "--save-interval", "3"])
    write_tracker(directory, 3)
    resumed = train(True, FLAGS + dropout + ["--load", directory])
    straight["losses"], straight["grad_norms"] = straight["losses"][3:], straight["grad_norms"][3:]
    assert_same_training(straight, resumed, rtol=1e-5, weight_atol=1e-5)
