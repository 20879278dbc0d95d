"""Which tensors are alive at a step's peak, ours against the PyTorch peer: the live set by allocating site.

The same two sides as ``benchmarks/parallel_overhead.py`` (one mode, 2 gloo processes, one thread each): each
is built and runs a warm-up and a measured step under the profiler with stacks. The profiler's event tree gives
every allocation's pointer, size and the ops / Python frames around it; replaying allocations and frees in time
order gives the live tensors at the moment of the measured step's peak. Rank 0's live set is printed grouped by
where each tensor was made ("before": made before the measured step, e.g. parameters and optimizer states).

    .venv/bin/python benchmarks/peak_live_tensors.py zero3 [--issue-sizes | --states-dominate] [--ops-only] [--rows 25]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile, record_function

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import parallel_overhead as bench  # noqa: E402


def _name(event: object) -> str:
    try:
        return event.name
    except UnicodeDecodeError:  # a few of the profiler's Python frame names are not valid UTF-8
        return "?"


def _site(event: object, depth: int = 4) -> str:
    """The innermost ``depth`` enclosing ops / project frames of an allocation (torch's own frames skipped)."""
    names, parent = [], event.parent
    while parent is not None and len(names) < depth:
        name = _name(parent)
        if not name.startswith("<built-in") and "torch/" not in name and "site-packages" not in name:
            names.append(name[-90:])
        parent = parent.parent
    return " <- ".join(names)


def live_at_peak(build: bench.Callable[[], bench.Step],
                 with_stack: bool = True) -> tuple[int, list[tuple[str, int, int]]]:
    """``(peak bytes, [(site, bytes, tensors)] alive at that moment, largest first)`` of the measured step.

    ``with_stack=False`` names sites by the enclosing ops only: far less profiler memory (the Python frames of a
    step of a large model took gigabytes per process)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=with_stack) as prof:
        step = build()
        step()
        with record_function(bench.MARK):
            step()
    allocations, marks, stack = [], [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if _name(event) == bench.MARK:
            marks.append(event.start_time_ns)
        if event.tag == torch._C._profiler._EventType.Allocation:
            allocations.append(event)
        stack.extend(event.children)
    start = min(marks)
    live: dict[int, tuple[int, str]] = {}
    alive = peak = 0
    peak_set: dict[int, tuple[int, str]] = {}
    for event in sorted(allocations, key=lambda e: e.start_time_ns):
        fields = event.extra_fields
        if fields.alloc_size > 0:
            when = "step" if event.start_time_ns >= start else "before"
            live[fields.ptr] = (fields.alloc_size, f"{when}: {_site(event)}")
        else:
            live.pop(fields.ptr, None)
        alive += fields.alloc_size
        if event.start_time_ns >= start and alive > peak:
            peak, peak_set = alive, dict(live)
    groups: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for size, site in peak_set.values():
        groups[site][0] += size
        groups[site][1] += 1
    return peak, sorted(((site, b, n) for site, (b, n) in groups.items()), key=lambda row: -row[1])


def run(rank: int, world: int, mode: str, sizes: bench.Sizes, with_stack: bool) -> dict | None:
    torch.set_num_threads(1)
    config = bench.our_config(mode, sizes, world)
    tokens = bench.global_batch(config, sizes.vocab)
    result = {"ours": live_at_peak(lambda: bench.build_ours(config, tokens), with_stack),
              "peer": live_at_peak(lambda: bench.PEERS[mode][1](config, tokens), with_stack)}
    return result if rank == 0 else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=bench.DATA_PARALLEL_MODES)
    parser.add_argument("--issue-sizes", action="store_true")
    parser.add_argument("--states-dominate", action="store_true", help="parallel_overhead.py's preset of that name")
    parser.add_argument("--ops-only", action="store_true",
                        help="name allocation sites by the enclosing ops, without Python frames (less memory)")
    parser.add_argument("--rows", type=int, default=25, help="largest groups shown per side")
    args = parser.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"
    from tests.distributed.harness import run_distributed

    sizes = bench.ISSUE if args.issue_sizes else bench.STATES_DOMINATE if args.states_dominate else bench.SMALL
    result = run_distributed(run, 2, args.mode, sizes, not args.ops_only, timeout=3600)[0]
    for side, name in (("ours", "megatron_like"), ("peer", bench.PEERS[args.mode][0])):
        peak, rows = result[side]
        print(f"== {args.mode}, {name}: peak {peak / 2**20:.1f} MiB live on rank 0")
        for site, nbytes, count in rows[: args.rows]:
            print(f"{nbytes / 2**20:9.2f} MiB {count:4d}  {site}")


if __name__ == "__main__":
    main()
