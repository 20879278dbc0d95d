"""Sequence parallelism at tp 2: what keeping only the shard of a column-parallel linear's input saves, and what
gathering it again in backward costs (``tensor_parallel/sequence_parallel_linear.py``).

Two gloo processes, one thread each, run our GPT (``parallel_overhead.py``'s ``tp`` mode: tp 2, sequence
parallelism) twice in one run: as it is ("re-gather") and with every sequence-parallel column-parallel linear
keeping its gathered input for backward, as before the change ("keep gathered": the gather, then the plain linear).
Per variant, on rank 0: the bytes one transformer layer saves for backward (autograd's saved-tensor hooks,
parameters excluded), the peak of live tensors in a training step (the profiler's allocation log, parameters and
optimizer states included) and the median CPU seconds of a step (every thread of the process, gloo's too), the
variants' steps alternating.

    .venv/bin/python benchmarks/sequence_parallel_memory.py [--steps 5] [--layers 4 --hidden 512 --seq 1024]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
from collections.abc import Callable

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import parallel_overhead as bench  # noqa: E402

from megatron_like.tensor_parallel import cpu_gemm, gather_from_sequence_parallel_region, layers  # noqa: E402
from tests.saved_tensors import kept_for_backward  # noqa: E402

VARIANTS = ("re-gather", "keep gathered")


def keep_gathered(shard: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tp_group, backend: str
                  ) -> torch.Tensor:
    """The column-parallel linear before the change: gather ``[s / tp, b, in]``, then a linear whose backward keeps
    the gathered ``[s, b, in]``."""
    return cpu_gemm.linear(gather_from_sequence_parallel_region(shard, tp_group), weight, bias, backend)


def with_variant(variant: str, fn: Callable[[], object]) -> object:
    """``fn()`` with the column-parallel linears of ``variant`` (its forwards and backwards run under it too)."""
    original = layers.sequence_parallel_column_linear
    if variant == "keep gathered":
        layers.sequence_parallel_column_linear = keep_gathered
    try:
        return fn()
    finally:
        layers.sequence_parallel_column_linear = original


def run(rank: int, world: int, sizes: bench.Sizes, steps: int) -> dict | None:
    from megatron_like.parallel_state import ParallelState
    from megatron_like.planning.activations import layer_activation_bytes

    torch.set_num_threads(1)
    config = bench.our_config("tp", sizes, world)
    tokens = bench.global_batch(config, sizes.vocab)
    results, stepping = {}, {}
    ps = ParallelState.initialize(config.parallel, world)
    for variant in VARIANTS:
        step, peak, _ = with_variant(variant, lambda: bench.profiled_side(lambda: bench.build_ours(config, tokens),
                                                                          peer=False))
        stepping[variant] = step
        results[variant] = {"layer": with_variant(variant, lambda: kept_for_backward(config, ps=ps)), "peak": peak,
                            "cpu": []}
    for _ in range(steps):
        for variant in VARIANTS:
            _, seconds, _ = with_variant(variant, functools.partial(bench.timed, stepping[variant]))
            results[variant]["cpu"].append(seconds)
    results["planned"] = layer_activation_bytes(config, None, "cpu")
    return results if rank == 0 else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=2)
    args = parser.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"
    from tests.distributed.harness import run_distributed

    sizes = bench.Sizes(layers=args.layers, hidden=args.hidden, heads=8, seq=args.seq, vocab=1024,
                        global_batch=args.micro_batch)
    result = run_distributed(run, 2, sizes, args.steps, timeout=3600)[0]
    print(f"GPT {sizes.layers} layers, h {sizes.hidden}, s {sizes.seq}, b {sizes.global_batch}, fp32, tp 2 + "
          f"sequence parallelism; rank 0; planner's layer bytes {result['planned'] / 2**20:.2f} MiB")
    print("| variant | saved by one layer (MiB) | step's peak live (MiB) | step CPU s (median) |")
    print("|---|---|---|---|")
    for variant in VARIANTS:
        r = result[variant]
        print(f"| {variant} | {r['layer'] / 2**20:.2f} | {r['peak'] / 2**20:.1f} | "
              f"{statistics.median(r['cpu']):.3f} |")
    ratio = statistics.median(a / b for a, b in zip(result["re-gather"]["cpu"], result["keep gathered"]["cpu"]))
    print(f"re-gather / keep gathered, step CPU time: {ratio:.3f} (median of per-step ratios)")


if __name__ == "__main__":
    main()
