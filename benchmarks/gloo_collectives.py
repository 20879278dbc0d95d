"""ZeRO's two flat collectives on gloo: torch's own against ``megatron_like.collectives``, CPU seconds per rank.

gloo has no reduce-scatter: torch's gloo ``reduce_scatter_tensor`` clones its input, all-reduces the clone and
copies this rank's chunk out; its ``all_gather_into_tensor`` gathers into a temporary as large as the output,
then copies it over. ``collectives.reduce_scatter_flat`` / ``all_gather_flat`` run an all-to-all plus a sum /
one in-place broadcast per rank instead (docs/distributed.md). For reference, the data-parallel peers' own
collectives: DDP's in-place all-reduce of the whole gradient and ``ZeroRedundancyOptimizer``'s broadcasts.

    .venv/bin/python benchmarks/gloo_collectives.py [--numel 22400000] [--trials 5] [--world-size 2]

Each trial runs every variant once, in turn, between barriers; the table gives the median wall and CPU seconds
(user + system of the whole process: gloo's threads included) of rank 0, and the busiest rank's CPU.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_like import collectives as comm  # noqa: E402


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run(rank: int, world: int, numel: int, trials: int) -> dict[str, list[tuple[float, float]]]:
    """On every rank: each variant ``trials`` times; ``{variant: [(wall s, CPU s)]}`` of this rank."""
    dist.init_process_group("gloo")
    group = dist.new_group(list(range(world)))
    gradient = torch.randn(numel)  # [world * n], a bucket's full fp32 gradient
    shard = torch.empty(numel // world)
    params = torch.empty(numel)

    def torch_reduce_scatter() -> None:
        dist.reduce_scatter_tensor(shard, gradient, group=group)

    def torch_all_gather() -> None:
        dist.all_gather_into_tensor(params, shard, group=group)

    def broadcast_per_rank() -> None:  # ZeroRedundancyOptimizer's way of sharing the updated params
        for r, chunk in enumerate(params.chunk(world)):
            dist.broadcast(chunk, src=r, group=group)

    variants = {
        "torch reduce_scatter_tensor": torch_reduce_scatter,
        "ours reduce_scatter_flat": lambda: comm.reduce_scatter_flat(shard, gradient, group),
        "torch all_gather_into_tensor": torch_all_gather,
        "ours all_gather_flat": lambda: comm.all_gather_flat(params, shard, group),
        "all_reduce (DDP)": lambda: dist.all_reduce(gradient, group=group),
        "broadcast per rank (ZeroRedundancyOptimizer)": broadcast_per_rank,
    }
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for _ in range(trials):
        for name, variant in variants.items():
            dist.barrier(group)
            begin, cpu = time.perf_counter(), _cpu_seconds()
            variant()
            cpu = _cpu_seconds() - cpu
            dist.barrier(group)
            results[name].append((time.perf_counter() - begin, cpu))
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=int, default=22_400_000, help="fp32 elements of the full tensor")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args(argv)
    if args.numel % args.world_size:
        parser.error(f"--numel {args.numel} must be a multiple of --world-size {args.world_size}")
    os.environ["OMP_NUM_THREADS"] = "1"
    from tests.distributed.harness import run_distributed

    results = run_distributed(run, args.world_size, args.numel, args.trials, timeout=1800)
    print(f"# {args.numel * 4 / 1e6:.0f} MB fp32 full tensor, {args.world_size} gloo processes x 1 thread, "
          f"{args.trials} trials, load average {os.getloadavg()[0]:.1f}")
    print("| collective | wall s (rank 0) | CPU s (rank 0) | CPU s (busiest rank) |")
    print("|---|---|---|---|")
    for name in results[0]:
        wall = statistics.median(w for w, _ in results[0][name])
        cpu = statistics.median(c for _, c in results[0][name])
        busiest = max(statistics.median(c for _, c in r[name]) for r in results)
        print(f"| {name} | {wall:.3f} | {cpu:.3f} | {busiest:.3f} |")


if __name__ == "__main__":
    main()
