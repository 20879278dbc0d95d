"""How long a torch_dist save blocks training: synchronous save versus ``--async-save``, in one run.

One process, a GPT of about 300M parameters (default: 20 layers, hidden 1024, vocab 50304, fp32) with
Adam state (one optimizer step on random gradients). Trials alternate between the two modes so a slow
period of the machine hits both. Reported per mode: the time ``save_checkpoint`` blocks the caller, and
for async also the time until the background write completed; and a raw sequential write (with fsync)
of as many bytes as one checkpoint holds, on the same disk.

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
from megatron_like.training.checkpointing import save_checkpoint
from megatron_like.training.loop import build_model_chunks
from megatron_like.training.lr_schedule import LearningRateScheduler
from megatron_like.training.parallelize import parallelize


def directory_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def raw_write(path: str, nbytes: int, block: int = 64 << 20) -> float:
    """Seconds to write ``nbytes`` sequentially and fsync them."""
    buffer = os.urandom(block)
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(0, nbytes, block):
            f.write(buffer)
        f.flush()
        os.fsync(f.fileno())
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

    blocked: dict[str, list[float]] = {"sync": [], "async": []}
    complete: list[float] = []
    nbytes = 0
    for trial in range(args.trials):
        for mode in ("sync", "async"):
            root = os.path.join(args.dir, mode)
            shutil.rmtree(root, ignore_errors=True)
            config.checkpoint.async_save = mode == "async"
            start = time.perf_counter()
            save_checkpoint(root, trial + 1, config, ps, model, optimizer, scheduler, 0)
            blocked[mode].append(time.perf_counter() - start)
            if mode == "async":
                dist_checkpointing.wait_for_async_save()
                complete.append(time.perf_counter() - start)
            nbytes = directory_bytes(root)
    raw = raw_write(os.path.join(args.dir, "raw.bin"), nbytes)
    shutil.rmtree(args.dir, ignore_errors=True)
    sync, asyn = statistics.median(blocked["sync"]), statistics.median(blocked["async"])
    print(f"checkpoint bytes: {nbytes / 1e9:.2f} GB")
    print(f"sync save blocks:  {sync:.2f} s (median of {args.trials}; {nbytes / sync / 1e9:.2f} GB/s)")
    print(f"async save blocks: {asyn:.2f} s = {100 * asyn / sync:.0f}% of sync; write complete after "
          f"{statistics.median(complete):.2f} s")
    print(f"raw sequential write + fsync of the same bytes: {raw:.2f} s ({nbytes / raw / 1e9:.2f} GB/s)")


if __name__ == "__main__":
    main()
