"""torch_dist checkpoint speed against the disk, in one run: save and load GB/s versus a raw sequential write
(with fsync) and read of as many bytes on the same disk, and how long ``--async-save`` blocks training.

One process, a GPT of about 300M parameters (default: 20 layers, hidden 1024, vocab 50304, fp32) with
Adam state (one optimizer step on random gradients). Each trial runs a DCP save + load and a raw write +
read of the same bytes, in alternating order, so a slow period of the machine hits both sides; reads
start with the files evicted from the page cache (``posix_fadvise(DONTNEED)`` after fsync), so they
come from the disk. Then an ``--async-save``: the time it blocks the caller and until the write completed.

    .venv/bin/python benchmarks/checkpoint_save.py [--dir /tmp/ckpt_bench] [--trials 2]
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import time

import torch

import pretrain_gpt
from megatron_like.config import parse_config
from megatron_like.parallel_state import ParallelState
from megatron_like.training import dist_checkpointing
from megatron_like.training.checkpointing import load_checkpoint, save_checkpoint
from megatron_like.training.loop import build_model_chunks
from megatron_like.training.lr_schedule import LearningRateScheduler
from megatron_like.training.parallelize import parallelize


def directory_files(path: str) -> list[str]:
    return [os.path.join(d, f) for d, _, files in os.walk(path) for f in files]


def evict(paths: list[str]) -> None:
    """Drop these files from the page cache (written back first), so the next read comes from the disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_write(path: str, nbytes: int, block: int = 64 << 20) -> float:
    """Seconds to write ``nbytes`` sequentially and fsync them."""
    buffer = os.urandom(block)
    start = time.perf_counter()
    with open(path, "wb") as f:
        for offset in range(0, nbytes, block):
            f.write(buffer[:min(block, nbytes - offset)])
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - start


def raw_read(path: str, block: int = 64 << 20) -> float:
    """Seconds to read ``path`` sequentially into one reused buffer (after evicting it from the page cache)."""
    evict([path])
    buffer = bytearray(block)
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buffer):
            pass
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default="/tmp/ckpt_bench")
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=1024)
    args = parser.parse_args()
    torch.manual_seed(0)
    flags = ["--num-layers", str(args.layers), "--hidden-size", str(args.hidden), "--num-attention-heads", "16",
             "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "1",
             "--global-batch-size", "1", "--train-iters", "10", "--lr", "1e-4", "--mock-data",
             "--vocab-size", "50304", "--ckpt-format", "torch_dist"]
    config = parse_config(flags, world_size=1)
    ps = ParallelState.initialize(config.parallel, 1)
    vocab = config.padded_vocab_size(config.model.vocab_size)
    model = build_model_chunks(config, ps, functools.partial(pretrain_gpt.model_provider, padded_vocab_size=vocab))
    _, optimizer = parallelize(config, ps, model)
    scheduler = LearningRateScheduler(optimizer, config.optimizer, config.training.train_iters)
    for bucket in optimizer.buckets:  # one step on random gradients: Adam's moments exist
        bucket.grad_shard.normal_(0, 1e-3)
    optimizer.step()
    n_params = sum(p.numel() for chunk in model for p in chunk.parameters())
    print(f"parameters: {n_params / 1e6:.0f}M")

    times: dict[str, list[float]] = {k: [] for k in ("sync", "async", "complete", "load", "raw_write", "raw_read")}
    nbytes = 0
    raw = os.path.join(args.dir, "raw.bin")
    for trial in range(args.trials):
        # Alternate the order of each pair so a slow period of the machine hits both sides.
        first, second = ("dcp", "raw") if trial % 2 == 0 else ("raw", "dcp")
        for side in (first, second):
            if side == "dcp":
                root = os.path.join(args.dir, "sync")
                shutil.rmtree(root, ignore_errors=True)
                config.checkpoint.async_save = False
                start = time.perf_counter()
                save_checkpoint(root, trial + 1, config, ps, model, optimizer, scheduler, 0)
                times["sync"].append(time.perf_counter() - start)
                nbytes = directory_bytes(root)
                evict(directory_files(root))
                start = time.perf_counter()
                load_checkpoint(root, config, ps, model, optimizer, scheduler)
                times["load"].append(time.perf_counter() - start)
            else:
                nbytes = nbytes or directory_bytes_of_first_save(args.dir, trial, config, ps, model, optimizer,
                                                                 scheduler)
                times["raw_write"].append(raw_write(raw, nbytes))
                times["raw_read"].append(raw_read(raw))
                os.remove(raw)
        root = os.path.join(args.dir, "async")
        shutil.rmtree(root, ignore_errors=True)
        config.checkpoint.async_save = True
        start = time.perf_counter()
        save_checkpoint(root, trial + 1, config, ps, model, optimizer, scheduler, 0)
        times["async"].append(time.perf_counter() - start)
        dist_checkpointing.wait_for_async_save()
        times["complete"].append(time.perf_counter() - start)
    shutil.rmtree(args.dir, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    gb = nbytes / 1e9
    print(f"checkpoint bytes: {gb:.2f} GB (medians of {args.trials} trials)")
    print(f"sync save:  {med['sync']:.2f} s, {gb / med['sync']:.2f} GB/s; raw write + fsync {med['raw_write']:.2f} s, "
          f"{gb / med['raw_write']:.2f} GB/s: save at {100 * med['raw_write'] / med['sync']:.0f}% of raw")
    print(f"load:       {med['load']:.2f} s, {gb / med['load']:.2f} GB/s; raw read {med['raw_read']:.2f} s, "
          f"{gb / med['raw_read']:.2f} GB/s: load at {100 * med['raw_read'] / med['load']:.0f}% of raw")
    print(f"async save blocks: {med['async']:.2f} s = {100 * med['async'] / med['sync']:.0f}% of sync; write "
          f"complete after {med['complete']:.2f} s")
    print("per trial:", {k: [round(x, 2) for x in v] for k, v in times.items()})


def directory_bytes(path: str) -> int:
    return sum(os.path.getsize(p) for p in directory_files(path))


def directory_bytes_of_first_save(directory: str, trial: int, config, ps, model, optimizer, scheduler) -> int:
    """The size of one checkpoint, for a raw side that runs before the first DCP save."""
    root = os.path.join(directory, "size")
    config.checkpoint.async_save = False
    save_checkpoint(root, trial + 1, config, ps, model, optimizer, scheduler, 0)
    nbytes = directory_bytes(root)
    shutil.rmtree(root)
    return nbytes


if __name__ == "__main__":
    main()
