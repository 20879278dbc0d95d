"""ZeRO's two flat collectives on gloo: torch's own against ``megatron_like.collectives``, CPU seconds per rank.

gloo has no reduce-scatter: torch's gloo ``reduce_scatter_tensor`` clones its input, all-reduces the clone and
copies this rank's chunk out; its ``all_gather_into_tensor`` gathers into a temporary as large as the output,
then copies it over. ``collectives.reduce_scatter_flat`` sends each other rank its chunk and receives theirs of its own
part ((w - 1) chunks), then adds them into its own chunk in place, as the ZeRO buffers call it;
``all_gather_flat`` runs one in-place broadcast per rank (docs/distributed.md). For reference: the all-to-all
plus a sum that ``reduce_scatter_flat`` was before (a receive buffer as large as the input, a separate output and
a copy into the shard, kept here only), and the data-parallel peers' own collectives: DDP's in-place all-reduce of
the whole gradient and ``ZeroRedundancyOptimizer``'s broadcasts.

    .venv/bin/python benchmarks/gloo_collectives.py [--numel 22400000] [--trials 5] [--world-size 2]

Each trial runs every variant once, in turn, between barriers; the table gives the median wall and CPU seconds
(user + system of the whole process: gloo's threads included) of rank 0, the busiest rank's CPU, and rank 0's
minor page faults (fresh pages touched: a new large buffer faults in each of its pages).
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


def _usage() -> tuple[float, int]:
    """(user + system CPU seconds, minor page faults) of this process so far, every thread."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime, usage.ru_minflt


def run(rank: int, world: int, numel: int, trials: int) -> dict[str, list[tuple[float, float, int]]]:
    """On every rank: each variant ``trials`` times; ``{variant: [(wall s, CPU s, minor faults)]}`` of this rank."""
    dist.init_process_group("gloo")
    group = dist.new_group(list(range(world)))
    gradient = torch.randn(numel)  # [world * n], a bucket's full fp32 gradient
    shard = torch.empty(numel // world)
    params = torch.empty(numel)

    def torch_reduce_scatter() -> None:
        dist.reduce_scatter_tensor(shard, gradient, group=group)

    def old_all_to_all_reduce_scatter() -> None:  # reduce_scatter_flat before: all-to-all, sum, copy into the shard
        received = torch.empty_like(gradient)
        dist.all_to_all_single(received, gradient, group=group)
        out = torch.empty(numel // world)
        torch.sum(received.view(world, -1), dim=0, out=out)
        gradient.view(world, -1)[rank].copy_(out)

    def torch_all_gather() -> None:
        dist.all_gather_into_tensor(params, shard, group=group)

    def broadcast_per_rank() -> None:  # ZeroRedundancyOptimizer's way of sharing the updated params
        for r, chunk in enumerate(params.chunk(world)):
            dist.broadcast(chunk, src=r, group=group)

    variants = {
        "torch reduce_scatter_tensor": torch_reduce_scatter,
        "old all-to-all + sum + copy (reference)": old_all_to_all_reduce_scatter,
        "ours reduce_scatter_flat, in place (send/recv)": lambda: comm.reduce_scatter_flat(
            gradient.view(world, -1)[rank], gradient, group),
        "torch all_gather_into_tensor": torch_all_gather,
        "ours all_gather_flat": lambda: comm.all_gather_flat(params, shard, group),
        "all_reduce (DDP)": lambda: dist.all_reduce(gradient, group=group),
        "broadcast per rank (ZeroRedundancyOptimizer)": broadcast_per_rank,
    }
    results: dict[str, list[tuple[float, float, int]]] = {name: [] for name in variants}
    for _ in range(trials):
        for name, variant in variants.items():
            dist.barrier(group)
            begin, (cpu, faults) = time.perf_counter(), _usage()
            variant()
            end_cpu, end_faults = _usage()
            dist.barrier(group)
            results[name].append((time.perf_counter() - begin, end_cpu - cpu, end_faults - faults))
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
    print("| collective | wall s (rank 0) | CPU s (rank 0) | CPU s (busiest rank) | minor faults (rank 0) |")
    print("|---|---|---|---|---|")
    for name in results[0]:
        wall = statistics.median(w for w, _, _ in results[0][name])
        cpu = statistics.median(c for _, c, _ in results[0][name])
        busiest = max(statistics.median(c for _, c, _ in r[name]) for r in results)
        faults = statistics.median(f for _, _, f in results[0][name])
        print(f"| {name} | {wall:.3f} | {cpu:.3f} | {busiest:.3f} | {faults:.0f} |")


if __name__ == "__main__":
    main()
