"""Context parallelism on 2 processes against one: peak live activation bytes per rank and step time, for each
--cp-comm-type, training a Llama-style model through ``pretrain_gpt.py`` (torchrun, mock data).

    .venv/bin/python benchmarks/context_parallel.py                      # s = 8192, 2 layers, hidden 256
    .venv/bin/python benchmarks/context_parallel.py --seq-length 16384 --iters 3

Each run prints Megatron's log line per iteration; this script reads its ``max live tensors (GiB)`` (the largest
live tensor bytes of the step on the logging rank, the profiler's allocation log: the resident set is inflated by
glibc, docs/design.md §8) and its ``elapsed time per iteration (ms)``, and reports the median over the iterations
after the first. Weights, gradients and Adam state of this small model are a few MB: the peak is the activations.
Every process runs one thread (``OMP_NUM_THREADS=1``): cp 2 uses two cores where one process uses one. Timings on
a shared machine are noisy: compare within one run.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINE = re.compile(r"iteration\s+(\d+)/.*elapsed time per iteration \(ms\): ([0-9.]+) .*max live tensors \(GiB\): "
                  r"([0-9.]+)")


def model_flags(seq_length: int, iters: int) -> list[str]:
    return [
        "--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4", "--group-query-attention",
        "--num-query-groups", "2", "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
        "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--seq-length", str(seq_length),
        "--max-position-embeddings", str(seq_length), "--micro-batch-size", "1", "--global-batch-size", "1",
        "--train-iters", str(iters), "--lr", "1e-4", "--mock-data", "--vocab-size", "512", "--log-interval", "1",
        "--eval-iters", "0", "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "1234",
    ]


def run(nproc: int, flags: list[str]) -> tuple[float, float]:
    """(median step ms, median peak live GiB) over the iterations after the first."""
    command = [os.path.join(ROOT, ".venv", "bin", "torchrun"), "--standalone", f"--nproc_per_node={nproc}",
               os.path.join(ROOT, "pretrain_gpt.py"), *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    rows = [(float(ms), float(gib)) for it, ms, gib in LINE.findall(out.stdout) if int(it) > 1]
    return statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-length", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=4)
    args = parser.parse_args()
    flags = model_flags(args.seq_length, args.iters)
    base_ms, base_gib = run(1, flags)
    print(f"seq {args.seq_length}, Llama-style 2 layers x hidden 256, 4 heads (2 KV), batch 1, fp32, 1 thread each")
    print(f"{'layout':<22} | {'step (ms)':>9} | {'vs 1 process':>12} | {'peak live (GiB)':>15} | {'vs 1 process':>12}")
    print(f"{'1 process':<22} | {base_ms:>9.0f} | {1.0:>12.2f} | {base_gib:>15.3f} | {1.0:>12.2f}")
    for comm_type in ("p2p", "all_gather", "a2a"):
        ms, gib = run(2, flags + ["--context-parallel-size", "2", "--cp-comm-type", comm_type])
        name = f"cp 2 {comm_type}"
        print(f"{name:<22} | {ms:>9.0f} | {ms / base_ms:>12.2f} | {gib:>15.3f} | {gib / base_gib:>12.2f}")


if __name__ == "__main__":
    main()
