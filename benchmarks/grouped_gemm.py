"""Grouped GEMM of an MoE expert layer against a Python loop over experts and one dense matmul of equal FLOPs.

    .venv/bin/python benchmarks/grouped_gemm.py              # E=8, T=4096*top2, k=512, n=1408
    .venv/bin/python benchmarks/grouped_gemm.py --quick      # small shapes, a smoke run
    .venv/bin/python benchmarks/grouped_gemm.py --threads 1 --dtypes float32   # what docs/performance.md shows

Three ways to compute ``y[T, n]`` from ``x[T, k]`` and per-expert ``w[E, k, n]``:

- ``grouped``: ``megatron_like.kernels.grouped_gemm`` (the C++ kernel: one call for all experts),
- ``loop``: its fallback, ``torch.mm`` per expert group from Python (MKL/oneDNN per group),
- ``dense``: one ``torch.mm`` of ``[T, k] @ [k, n]``, the same FLOPs with no grouping at all (the bound).

for a uniform and a skewed split of the rows over experts, forward and forward+backward (grads of x and
w). Each round times the three in turn, the order rotating every round so that the machine's load swings
hit all alike; the table gives the median of --rounds rounds, GFLOP/s and the ratio to ``loop``. A row
for ``permute`` + ``unpermute`` (forward+backward) of the same tokens shows what the token shuffling costs
next to the GEMMs. Timing on a shared machine is noisy: compare ratios from one run, not runs.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_like.kernels import (  # noqa: E402 - after the path tweak, for runs from a checkout
    csrc_available,
    csrc_isa,
    grouped_gemm,
)
from megatron_like.kernels.grouped_gemm import grouped_gemm_reference  # noqa: E402
from megatron_like.model.moe.permutation import permute, permuted_probs, unpermute  # noqa: E402


def split(rows: int, experts: int, skew: bool) -> torch.Tensor:
    """Rows per expert: equal, or skewed (expert e gets a share ~ 1/(e+1), the last one possibly none)."""
    if not skew:
        weights = torch.ones(experts)
    else:
        weights = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64)
        weights[-1] = 0.0  # an expert without tokens
    counts = torch.floor(weights / weights.sum() * rows).long()
    counts[0] += rows - int(counts.sum())
    return counts


def median_ms(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median milliseconds per function, timed in rotating order each round after one warm-up call each."""
    names = list(fns)
    for name in names:
        fns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def gemm_fns(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, backward: bool) -> dict[str, Callable]:
    """The three ways, as closures doing forward (and backward with a fixed dy when asked)."""
    w_dense = w[0].detach().clone().requires_grad_(w.requires_grad)

    def wrap(fn, weight):
        if not backward:
            return lambda: fn(x, weight)
        dy = torch.randn(x.shape[0], w.shape[2], dtype=x.dtype)

        def step():
            xs, ws = x.detach().requires_grad_(), weight.detach().requires_grad_()
            fn(xs, ws).backward(dy)
        return step

    return {
        "grouped": wrap(lambda a, b: grouped_gemm(a, b, counts), w),
        "loop": wrap(lambda a, b: grouped_gemm_reference(a, b, counts), w),
        "dense": wrap(torch.mm, w_dense),
    }


def permute_fn(tokens: torch.Tensor, experts: int, topk: int) -> Callable[[], object]:
    """permute -> (identity experts) -> unpermute, forward and backward, for T / topk tokens routed top-k."""
    gen = torch.Generator().manual_seed(0)
    num_tokens = tokens.shape[0] // topk
    hidden = tokens[:num_tokens]
    scores = torch.rand(num_tokens, experts, generator=gen)
    routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, scores.topk(topk, dim=-1).indices, True)
    weights = permuted_probs(scores.softmax(-1), routing_map)

    def step():
        h = hidden.detach().requires_grad_()
        permuted, token_index, _ = permute(h, routing_map)
        unpermute(permuted, token_index, weights, num_tokens).sum().backward()
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens before routing")
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512, help="k: the expert input size")
    parser.add_argument("--ffn", type=int, default=1408, help="n: the expert output size")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="torch (and kernel) threads; default torch's")
    parser.add_argument("--quick", action="store_true", help="small shapes, a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.hidden, args.ffn = 256, 64, 176
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if not csrc_available("grouped_gemm"):
        sys.exit("the grouped_gemm kernel is not built: the 'grouped' column would be the loop itself")
    rows = args.tokens * args.topk
    flops = 2 * rows * args.hidden * args.ffn
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, kernel path {csrc_isa()}")
    print(f"# E={args.experts}, T={args.tokens}*top{args.topk}={rows} rows, k={args.hidden}, n={args.ffn}, "
          f"median of {args.rounds} rounds")
    print("| dtype | split | pass | grouped ms | loop ms | dense ms | grouped GFLOP/s | loop / grouped | "
          "dense / grouped |")
    print("|---|---|---|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        x = torch.randn(rows, args.hidden, generator=gen).to(dtype)
        w = (torch.randn(args.experts, args.hidden, args.ffn, generator=gen) / args.hidden**0.5).to(dtype)
        for skew in (False, True):
            counts = split(rows, args.experts, skew)
            for backward in (False, True):
                ms = median_ms(gemm_fns(x, w, counts, backward), args.rounds)
                work = flops * (3 if backward else 1)
                print(f"| {dtype_name} | {'skewed' if skew else 'uniform'} {counts.tolist()} | "
                      f"{'fwd+bwd' if backward else 'fwd'} | {ms['grouped']:.1f} | {ms['loop']:.1f} | "
                      f"{ms['dense']:.1f} | {work / ms['grouped'] / 1e6:.1f} | {ms['loop'] / ms['grouped']:.2f} | "
                      f"{ms['dense'] / ms['grouped']:.2f} |")
        shuffle = median_ms({"permute": permute_fn(x, args.experts, args.topk)}, args.rounds)["permute"]
        print(f"| {dtype_name} | permute + unpermute, h={args.hidden} | fwd+bwd | {shuffle:.1f} | | | | | |")


if __name__ == "__main__":
    main()
