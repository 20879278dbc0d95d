"""``--ckpt-format torch_dist`` loads at another layout and training continues as if never interrupted.

One group of 4 processes, both directions between
  A = tp2 x pp2 with 2 virtual stages per rank, ZeRO-1 over dp 1, and
  B = tp1 x pp2 x dp2, ZeRO-3 with the optimizer offloaded to the CPU:
a straight run of 6 iterations at the saving layout also saves at iteration 3; a second run at the other
layout loads that checkpoint (weights, fp32 masters, Adam moments and step, lr schedule, data position)
and trains iterations 4-6. Its losses, grad norms and final weights must equal the straight run's within
float32 tolerance (the two layouts compute the same model, see test_zero.py and test_pipeline_parallel.py).

--async-save (bf16, ZeRO-2 over dp 2): the checkpoint staged and written in the background while the next
iteration runs equals a synchronous save of the same iteration bitwise, holds the state of the
iteration it was taken at and resumes bitwise (dropout on, fp32 masters included); the run ends only
once its last checkpoint is named by the tracker.
"""

from __future__ import annotations

import os
import threading

import torch

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
    from megatron_like.optimizer.distributed_optimizer import DistributedOptimizer
    from megatron_like.training import dist_checkpointing
    from megatron_like.training.checkpointing import latest_iteration
    from tests.distributed.test_checkpoint_resume import RESUME_FLAGS

    # The background thread of a save copies the state only once the training thread waits for the copy or
    # has run the next optimizer step (or ends), and writes only after that step: what it writes must be the
    # state of the save's iteration, copied before the step changed it. Gates per thread: no timing involved.
    gates: dict[tuple[threading.Thread, str], threading.Event] = {}

    def gate(thread: threading.Thread | None, kind: str) -> threading.Event:
        return gates.setdefault((thread, kind), threading.Event())

    def release(*kinds: str) -> None:  # the gates of the running save's thread
        for kind in kinds:
            gate(dist_checkpointing._AsyncWrite.thread, kind).set()

    step, wait_staging, wait_save = (DistributedOptimizer.step, dist_checkpointing.wait_for_async_staging,
                                     dist_checkpointing.wait_for_async_save)

    def step_then_release(self: DistributedOptimizer):  # noqa: ANN202 - the optimizer's own signature
        result = step(self)
        release("copy", "write")  # a copy nothing waited for now sees the step's changes
        return result

    def release_then_wait_staging() -> None:
        release("copy")
        wait_staging()

    def release_then_wait_save() -> None:
        release("copy", "write")
        wait_save()

    DistributedOptimizer.step = step_then_release
    dist_checkpointing.wait_for_async_staging = release_then_wait_staging
    dist_checkpointing.wait_for_async_save = release_then_wait_save
    dist_checkpointing.before_async_staging = lambda: gate(threading.current_thread(), "copy").wait()
    dist_checkpointing.before_async_write = lambda: gate(threading.current_thread(), "write").wait()
    # bf16: the separate fp32 masters are saved and loaded too.
    flags = RESUME_FLAGS + ["--zero-stage", "2", "--bf16", "--ckpt-format", "torch_dist", "--train-iters", "6",
                            "--save-interval", "3"]
    train_gpt(rank, world_size, flags + ["--save", os.path.join(root, "sync")])
    straight = train_gpt(rank, world_size, flags + ["--async-save", "--save", os.path.join(root, "async")])
    finished_at = latest_iteration(os.path.join(root, "async"))  # the end of training waited for the last write
    comm.barrier()
    if rank == 0:
        write_tracker(os.path.join(root, "async"), 3)
    comm.barrier()
    resumed = train_gpt(rank, world_size, flags + ["--async-save", "--load", os.path.join(root, "async")])
    return {"straight": straight["losses"], "resumed": resumed["losses"], "finished_at": finished_at}


def saved_state(root: str, iteration: int) -> dict:
    """Every tensor and plain value (RNG states) of a torch_dist checkpoint."""
    from torch.distributed.checkpoint import FileSystemReader

    from megatron_like.training.dist_checkpointing import read_full_tensors

    keys = list(FileSystemReader(os.path.join(root, f"iter_{iteration:07d}")).read_metadata().state_dict_metadata)
    return read_full_tensors(root, keys, iteration)


def test_async_save_writes_the_state_of_its_iteration_and_resumes_bitwise(tmp_path):
    """Staged during the next iteration, an async save equals a sync save of the same iteration bitwise
    (params, bf16 and fp32 masters, Adam moments, RNG states of both ranks)."""
    results = run_distributed(async_save_then_resume, 2, str(tmp_path))
    for iteration in (3, 6):
        sync, saved = saved_state(str(tmp_path / "sync"), iteration), saved_state(str(tmp_path / "async"), iteration)
        assert sorted(sync) == sorted(saved) and any(k.startswith("optimizer.master.") for k in sync)
        for key, value in sync.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, saved[key]), (iteration, key)
            else:
                assert_same_values(value, saved[key], (iteration, key))
    for r in results:
        assert r["finished_at"] == 6
        assert len(r["straight"]) == 6 and r["resumed"] == r["straight"][3:]


def assert_same_values(a, b, where) -> None:
    """Equal nested values (RNG states: lists, numbers and tensors), tensors bitwise."""
    if isinstance(a, dict):
        assert sorted(a) == sorted(b), where
        for key in a:
            assert_same_values(a[key], b[key], where)
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    else:
        assert a == b, where
