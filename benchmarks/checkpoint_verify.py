"""What checking the CRC-32s of a checkpoint costs, in one run: CPU seconds of loads with and without the
verification (alternating, page cache warm: the CPU cost, not the disk's), both formats, and of saves with
torch.save's CRC-32 on and off (on is torch's default and what every save of this code uses).

One process, a GPT of about 45M parameters (default: 6 layers, hidden 512, vocab 50304, fp32) with Adam state.
"Off" for the loads switches the two checks of ``checkpoint_integrity.py`` off (``verify_archive`` and
``SavedArchive.check``); everything else (the vetted index, file checks) runs either way.

    .venv/bin/python benchmarks/checkpoint_verify.py [--dir /tmp/ckpt_verify] [--trials 3]
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import sys
import time
from unittest import mock

import torch

# Run as `python benchmarks/...` from anywhere: the repository root holds pretrain_gpt.py, megatron_like/ and tests/.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pretrain_gpt
from megatron_like.config import parse_config
from megatron_like.parallel_state import ParallelState
from megatron_like.tensor_parallel import seed_everything
from megatron_like.training import checkpoint_integrity, checkpoint_validation, checkpointing
from megatron_like.training.checkpointing import checksummed_saves, load_checkpoint, save_checkpoint
from megatron_like.training.loop import build_model_chunks
from megatron_like.training.lr_schedule import LearningRateScheduler
from megatron_like.training.parallelize import parallelize


def cpu_seconds(run) -> float:
    start = time.process_time()
    run()
    return time.process_time() - start


def unverified():
    """The loads' CRC-32 checks switched off (both formats)."""
    return mock.patch.multiple(checkpoint_integrity.SavedArchive, check=lambda self, name, data: None), \
        mock.patch.object(checkpoint_validation, "verify_archive", lambda source, what: True), \
        mock.patch("megatron_like.training.dist_checkpointing.verify_archive", lambda source, what: True)


def measure(fmt: str, args: argparse.Namespace, ps: ParallelState | None) -> ParallelState:
    """Print the save and load CPU seconds of one format; returns the process's ParallelState (made once)."""
    flags = ["--num-layers", str(args.layers), "--hidden-size", str(args.hidden), "--num-attention-heads", "16",
             "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "1",
             "--global-batch-size", "1", "--train-iters", "1000", "--lr", "1e-4", "--mock-data",
             "--vocab-size", "50304", "--ckpt-format", fmt]
    config = parse_config(flags, world_size=1)
    ps = ps or ParallelState.initialize(config.parallel, 1)
    seed_everything(0, ps.tp_rank, ps.pp_rank)
    vocab = config.padded_vocab_size(config.model.vocab_size)
    model = build_model_chunks(config, ps, functools.partial(pretrain_gpt.model_provider, padded_vocab_size=vocab))
    _, optimizer = parallelize(config, ps, model)
    scheduler = LearningRateScheduler(optimizer, config.optimizer, config.training.train_iters)
    for bucket in optimizer.buckets:  # one step on random gradients: Adam's moments exist
        bucket.grad_shard.normal_(0, 1e-3)
    optimizer.step()
    root = os.path.join(args.dir, fmt)

    def save(crc: bool) -> None:
        shutil.rmtree(root, ignore_errors=True)
        with mock.patch.object(checkpointing, "checksummed_saves", lambda: checksummed_saves(crc)):
            save_checkpoint(root, 1, config, ps, model, optimizer, scheduler, 0)

    def load() -> None:
        load_checkpoint(root, config, ps, model, optimizer, scheduler)

    times: dict[str, list[float]] = {"save on": [], "save off": [], "load verified": [], "load unverified": []}
    for _ in range(args.trials):
        for crc in (True, False):
            times[f"save {'on' if crc else 'off'}"].append(cpu_seconds(functools.partial(save, crc)))
        save(True)
        load()  # warm the page cache
        times["load verified"].append(cpu_seconds(load))
        patches = unverified()
        with patches[0], patches[1], patches[2]:
            times["load unverified"].append(cpu_seconds(load))
    shutil.rmtree(root, ignore_errors=True)
    median = {k: statistics.median(v) for k, v in times.items()}
    nbytes = sum(p.numel() * p.element_size() for chunk in model for p in chunk.parameters()) * 3
    print(f"{fmt} ({nbytes / 1e9:.2f} GB of weights and moments), CPU seconds, median of {args.trials}:")
    print(f"  save: CRC-32 on {median['save on']:.2f}, off {median['save off']:.2f} "
          f"(on / off = {median['save on'] / median['save off']:.2f})")
    print(f"  load: verified {median['load verified']:.2f}, unverified {median['load unverified']:.2f} "
          f"(verified / unverified = {median['load verified'] / median['load unverified']:.2f})")
    print(f"  per trial: {({k: [round(x, 2) for x in v] for k, v in times.items()})}", flush=True)
    return ps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default="/tmp/ckpt_verify")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=512)
    args = parser.parse_args()
    ps = None
    for fmt in ("torch_dist", "torch"):
        ps = measure(fmt, args, ps)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
