"""CPU cost of the zero-bubble split backward: one GPT (one process, one thread), a plain backward against B then W.

    .venv/bin/python benchmarks/split_backward_cost.py                       # hidden 64 and 256
    .venv/bin/python benchmarks/split_backward_cost.py --hidden 256 --seq 128 --profile

Per micro batch: forward + ``backward()`` (plain), against forward with split ops + a B step
(``weight_grad.deferring_weight_grads``) + its W step (``WeightGradWork.run``), as the zero-bubble schedules run
them. CPU seconds of the process (``time.process_time``), the median of ``--repeats`` rounds; ``--profile`` prints
torch.profiler's operator table of both, to see where the difference goes.

glibc returns the top of its heap to the system when more than a threshold of it is free, and the split's higher
peak (each GEMM's output gradient kept from B to W) crosses it where a plain backward does not: the split then
pays page faults for memory it freed and allocates again. A GPU's caching allocator keeps freed blocks; to
measure that way here, keep freed memory in the process::

    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=1073741824 .venv/bin/python benchmarks/split_backward_cost.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_like.config import parse_config  # noqa: E402
from megatron_like.model import GPTModel  # noqa: E402
from megatron_like.parallel_state import ParallelState  # noqa: E402
from megatron_like.tensor_parallel import weight_grad  # noqa: E402


def build(hidden: int, seq: int) -> tuple[GPTModel, torch.Tensor]:
    config = parse_config(["--num-layers", "4", "--hidden-size", str(hidden), "--num-attention-heads", "4",
                           "--seq-length", str(seq), "--max-position-embeddings", str(seq), "--micro-batch-size", "1",
                           "--mock-data", "--vocab-size", "1024", "--hidden-dropout", "0", "--attention-dropout", "0"])
    model = GPTModel(config.model, ParallelState.single_process(torch.device("cpu")), vocab_size=1024, seed=1)
    return model, torch.randint(0, 1024, (1, seq))


def steps(model: GPTModel, ids: torch.Tensor):
    positions = torch.arange(ids.shape[1])[None]
    params = list(model.parameters())

    def plain() -> None:
        model(ids, positions, labels=ids).float().mean().backward()

    def split() -> None:
        with weight_grad.split_backward():
            loss = model(ids, positions, labels=ids).float().mean()
            with weight_grad.deferring_weight_grads(params) as work:
                loss.backward()
            work.run()

    return plain, split


def cpu_seconds(step, iterations: int) -> float:
    start = time.process_time()
    for _ in range(iterations):
        step()
    return (time.process_time() - start) / iterations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--seq", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    malloc = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
    print(f"# load average {os.getloadavg()[0]:.1f}, torch {torch.__version__}, glibc malloc {malloc or 'defaults'}")
    print("| hidden | seq | plain ms | split (B + W) ms | split / plain |")
    print("|---:|---:|---:|---:|---:|")
    for hidden, seq in zip(args.hidden, args.seq):
        plain, split = steps(*build(hidden, seq))
        for step in (plain, split):
            cpu_seconds(step, 3)
        rounds = [(cpu_seconds(plain, args.iterations), cpu_seconds(split, args.iterations))
                  for _ in range(args.repeats)]  # alternated, so a slow period of the machine hits both
        a, b = statistics.median(r[0] for r in rounds), statistics.median(r[1] for r in rounds)
        print(f"| {hidden} | {seq} | {a * 1e3:.2f} | {b * 1e3:.2f} | {b / a:.3f} |")
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            for name, step in (("plain", plain), ("split", split)):
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    for _ in range(args.iterations):
                        step()
                print(name)
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
