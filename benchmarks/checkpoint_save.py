"""torch_dist checkpoint speed against the disk, in one run: save and load GB/s versus a raw sequential write
(with fsync) and read of as many bytes on the same disk, and how long ``--async-save`` blocks training.

One process, a GPT of about 300M parameters (default: 20 layers, hidden 1024, vocab 50304, fp32) with
Adam state. Each trial runs a DCP save + load and a raw write + read of the same bytes, in alternating
order, so a slow period of the machine hits both sides; reads start with the files evicted from the page
cache (``posix_fadvise(DONTNEED)`` after fsync), so they come from the disk.

Then training iterations (``train_step``, as the loop runs them) with saves in between, sync and async
alternating. The time a save blocks the loop is the extra time of the iterations around it: from the
start of the save call to the end of the first iteration after the write completed (for a sync save:
the save and the next iteration), minus as many iterations without a save (the median of the two just
before and the two just after it: the load of a shared machine drifts). So it counts
everything the save costs the loop: the call, waiting for the copy before the next optimizer step, and
training slowed by the background copy and write competing for the cores. The first async save
allocates its host buffers; it is reported apart from the later ones, which reuse them (as a training
run's saves do). CPU seconds (all threads) beside wall seconds: the machine's load disturbs them less.

    .venv/bin/python benchmarks/checkpoint_save.py [--dir /tmp/ckpt_bench] [--trials 2]
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import sys
import time

import torch

# Run as `python benchmarks/...` from anywhere: the repository root holds pretrain_gpt.py, megatron_like/ and tests/.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pretrain_gpt
from megatron_like.config import parse_config
from megatron_like.data.mock_dataset import MockGPTDataset
from megatron_like.parallel_state import ParallelState
from megatron_like.tensor_parallel import seed_everything
from megatron_like.training import dist_checkpointing
from megatron_like.training.checkpointing import load_checkpoint, save_checkpoint
from megatron_like.training.loop import build_model_chunks, train_step
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
             "--global-batch-size", "1", "--train-iters", "1000", "--lr", "1e-4", "--mock-data",
             "--vocab-size", "50304", "--ckpt-format", "torch_dist"]
    config = parse_config(flags, world_size=1)
    ps = ParallelState.initialize(config.parallel, 1)
    seed_everything(0, ps.tp_rank, ps.pp_rank)
    vocab = config.padded_vocab_size(config.model.vocab_size)
    model = build_model_chunks(config, ps, functools.partial(pretrain_gpt.model_provider, padded_vocab_size=vocab))
    _, optimizer = parallelize(config, ps, model)
    scheduler = LearningRateScheduler(optimizer, config.optimizer, config.training.train_iters)
    for bucket in optimizer.buckets:  # one step on random gradients: Adam's moments exist
        bucket.grad_shard.normal_(0, 1e-3)
    optimizer.step()
    n_params = sum(p.numel() for chunk in model for p in chunk.parameters())
    print(f"parameters: {n_params / 1e6:.0f}M")

    times: dict[str, list[float]] = {k: [] for k in ("sync", "load", "raw_write", "raw_read")}
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
    med = {k: statistics.median(v) for k, v in times.items()}
    gb = nbytes / 1e9
    print(f"checkpoint bytes: {gb:.2f} GB (medians of {args.trials} trials)")
    print(f"sync save:  {med['sync']:.2f} s, {gb / med['sync']:.2f} GB/s; raw write + fsync {med['raw_write']:.2f} s, "
          f"{gb / med['raw_write']:.2f} GB/s: save at {100 * med['raw_write'] / med['sync']:.0f}% of raw")
    print(f"load:       {med['load']:.2f} s, {gb / med['load']:.2f} GB/s; raw read {med['raw_read']:.2f} s, "
          f"{gb / med['raw_read']:.2f} GB/s: load at {100 * med['raw_read'] / med['load']:.0f}% of raw")
    print("per trial:", {k: [round(x, 2) for x in v] for k, v in times.items()})
    blocking_in_training(args, config, ps, model, optimizer, scheduler)


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


def blocking_in_training(args: argparse.Namespace, config, ps, model, optimizer, scheduler) -> None:
    """Train with sync and async saves alternating; print the time each blocks the loop (module docstring)."""
    dataset = MockGPTDataset(10_000, config.model.seq_length, config.model.vocab_size, 0)
    data = iter(torch.utils.data.DataLoader(dataset, batch_size=1))
    clock = {"wall": time.perf_counter, "cpu": time.process_time}

    def now() -> dict[str, float]:
        return {k: f() for k, f in clock.items()}

    def since(start: dict[str, float]) -> dict[str, float]:
        return {k: f() - start[k] for k, f in clock.items()}

    def iteration() -> None:
        train_step(config, ps, pretrain_gpt.forward_step, data, model, optimizer, scheduler)

    # The loop's own waits (the save call, and train_step waiting for the copy before the optimizer step): what
    # an async save blocks when the training does not need the cores the write uses (a GPU run's host).
    waited = [0.0]
    wait_for_staging = dist_checkpointing.wait_for_async_staging

    @functools.wraps(wait_for_staging)
    def timed_wait_for_staging() -> None:
        start = time.perf_counter()
        wait_for_staging()
        waited[0] += time.perf_counter() - start

    dist_checkpointing.wait_for_async_staging = timed_wait_for_staging
    waits: dict[str, list[float]] = {"sync": [], "async": []}
    plain: list[list[dict[str, float]]] = []  # before each save and after the last: iterations without a save
    windows: list[tuple[str, dict[str, float], int]] = []  # (sync or async, seconds, iterations)
    config.checkpoint.async_save = True  # train_step waits for an async save's copy before the step
    root = os.path.join(args.dir, "train")
    saves = ["async"] + [mode for trial in range(args.trials)
                         for mode in (("sync", "async") if trial % 2 == 0 else ("async", "sync"))]
    iteration()  # warm-up

    def plain_iterations() -> None:
        plain.append([])
        for _ in range(2):
            start = now()
            iteration()
            plain[-1].append(since(start))

    for number, mode in enumerate(saves, 1):
        plain_iterations()
        shutil.rmtree(root, ignore_errors=True)
        config.checkpoint.async_save = mode == "async"
        start, count = now(), 1
        save_checkpoint(root, number, config, ps, model, optimizer, scheduler, 0)
        waited[0] = time.perf_counter() - start["wall"]
        config.checkpoint.async_save = True
        iteration()
        while dist_checkpointing.writing():
            iteration()
            count += 1
        dist_checkpointing.wait_for_async_save(ps)
        windows.append((mode, since(start), count))
        waits[mode].append(waited[0])
    plain_iterations()
    shutil.rmtree(root, ignore_errors=True)

    # Each save against the iterations just before and just after it: the machine's load drifts.
    blocked: dict[str, list[dict[str, float]]] = {"sync": [], "async": []}
    for (mode, seconds, count), before, after in zip(windows, plain, plain[1:]):
        base = {k: statistics.median(p[k] for p in before + after) for k in clock}
        blocked[mode].append({k: seconds[k] - count * base[k] for k in clock})
    base = {k: statistics.median(p[k] for run in plain for p in run) for k in clock}
    sync = {k: statistics.median(b[k] for b in blocked["sync"]) for k in clock}
    first, later = blocked["async"][0], blocked["async"][1:]
    steady = {k: statistics.median(b[k] for b in later) for k in clock}
    counts = [count for mode, _, count in windows[1:] if mode == "async"]
    print(f"iteration without a save: {base['wall']:.2f} s wall, {base['cpu']:.2f} s CPU (median of "
          f"{sum(map(len, plain))})")
    print(f"sync save blocks the loop:  {sync['wall']:.2f} s wall, {sync['cpu']:.2f} s CPU")
    print(f"async save blocks the loop: {steady['wall']:.2f} s wall = {100 * steady['wall'] / sync['wall']:.0f}% "
          f"of sync, {steady['cpu']:.2f} s CPU = {100 * steady['cpu'] / sync['cpu']:.0f}% (median of {len(later)} "
          f"saves reusing their buffers, over {statistics.median(counts):.0f} "
          f"iterations); first save {first['wall']:.2f} s wall = {100 * first['wall'] / sync['wall']:.0f}%, "
          f"{first['cpu']:.2f} s CPU")
    loop_waits = statistics.median(waits["async"][1:])
    print(f"async save: the loop itself waits {loop_waits:.2f} s (the call and the copy before the optimizer step) = "
          f"{100 * loop_waits / statistics.median(waits['sync']):.0f}% of a sync save's call "
          f"({statistics.median(waits['sync']):.2f} s); the rest of its blocked time is the background copy and write "
          f"competing with training for the cores")
    print("blocked per save (wall, CPU):", {mode: [(round(b["wall"], 2), round(b["cpu"], 2)) for b in runs]
                                            for mode, runs in blocked.items()})
    print("iterations without a save:", [[(round(p["wall"], 2), round(p["cpu"], 2)) for p in run] for run in plain])
    dist_checkpointing.wait_for_async_staging = wait_for_staging


if __name__ == "__main__":
    main()
