"""Where a step's CPU time goes, ours against the PyTorch peer: thread CPU seconds per aten op, per rank.

The same two sides as ``benchmarks/parallel_overhead.py`` (one mode, 2 gloo processes, one thread each). Each side
is built and runs a warm-up step; then one step runs under a dispatch mode that times every op it sees with
``time.thread_time`` (the main thread's CPU seconds: other jobs on the machine do not inflate it, gloo's worker
threads are not in it). For DTensor the mode sees the op on DTensors, so an op's time includes DTensor's
sharding propagation and any redistribution it runs; the local op inside is not counted again. ``outside ops``
is the step's thread time less the ops': Python, autograd's engine, hooks.

    .venv/bin/python benchmarks/op_cpu_time.py tp --issue-sizes [--rows 25]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import parallel_overhead as bench  # noqa: E402


class time_ops(TorchDispatchMode):  # noqa: N801 - used like a function: ``with time_ops() as ops:``
    """Thread CPU seconds and calls per op name (``aten.mm``, ``c10d.allreduce_``...) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: dict[str, int] = collections.defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - dispatch protocol
        begin = time.thread_time()
        out = func(*args, **(kwargs or {}))
        name = f"{func.namespace}.{func._overloadpacket.__name__}"
        self.seconds[name] += time.thread_time() - begin
        self.calls[name] += 1
        return out


def timed_step(step: bench.Step) -> dict:
    """One step (after one warm-up) under ``time_ops``: ``{"total": s, "ops": {name: (s, calls)}}``."""
    step()
    bench.comm.barrier()
    begin = time.thread_time()
    with time_ops() as ops:
        step()
    total = time.thread_time() - begin
    return {"total": total, "ops": {name: (ops.seconds[name], ops.calls[name]) for name in ops.seconds}}


def run(rank: int, world: int, mode: str, sizes: bench.Sizes) -> dict:
    torch.set_num_threads(1)
    config = bench.our_config(mode, sizes, world)
    tokens = bench.global_batch(config, sizes.vocab)
    ours = timed_step(bench.build_ours(config, tokens))
    peer = timed_step(bench.PEERS[mode][1](config, tokens))
    return {"ours": ours, "peer": peer}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=bench.MODES)
    parser.add_argument("--issue-sizes", action="store_true")
    parser.add_argument("--rows", type=int, default=25, help="largest ops shown")
    args = parser.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"
    from tests.distributed.harness import run_distributed

    sizes = bench.ISSUE if args.issue_sizes else bench.SMALL
    results = run_distributed(run, 2, args.mode, sizes, timeout=3600)
    for rank, result in enumerate(results):
        ours, peer = result["ours"], result["peer"]
        names = sorted(set(ours["ops"]) | set(peer["ops"]),
                       key=lambda n: -max(ours["ops"].get(n, (0, 0))[0], peer["ops"].get(n, (0, 0))[0]))
        print(f"== {args.mode}, rank {rank}: thread CPU s of one step, megatron_like {ours['total']:.3f}, "
              f"{bench.PEERS[args.mode][0]} {peer['total']:.3f}")
        print("| op | ours s | ours calls | peer s | peer calls |")
        print("|---|---|---|---|---|")
        for side in (ours, peer):
            side["ops"]["(outside ops)"] = (side["total"] - sum(s for s, _ in side["ops"].values()), 0)
        for name in ["(outside ops)"] + names[: args.rows]:
            (a, na), (b, nb) = ours["ops"].get(name, (0.0, 0)), peer["ops"].get(name, (0.0, 0))
            print(f"| {name} | {a:.3f} | {na} | {b:.3f} | {nb} |")


if __name__ == "__main__":
    main()
