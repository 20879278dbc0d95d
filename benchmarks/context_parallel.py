"""Context parallelism on 2 processes against one: peak live activation bytes per rank and step time, for each
--cp-comm-type, training a Llama-style model through ``pretrain_gpt.py`` (torchrun, mock data); and, with
``--against-pytorch``, our cp attention layer against PyTorch's own context parallelism on the same inputs.

    .venv/bin/python benchmarks/context_parallel.py                      # s = 8192, 2 layers, hidden 256
    .venv/bin/python benchmarks/context_parallel.py --seq-length 16384 --iters 3
    .venv/bin/python benchmarks/context_parallel.py --against-pytorch --seq-length 8192

Each run prints Megatron's log line per iteration; this script reads its ``max live tensors (GiB)`` (the largest
live tensor bytes of the step on the logging rank, the profiler's allocation log: the resident set is inflated by
glibc, docs/design.md §8) and its ``elapsed time per iteration (ms)``, and reports the median over the iterations
after the first. Weights, gradients and Adam state of this small model are a few MB: the peak is the activations.
Every process runs one thread (``OMP_NUM_THREADS=1``): cp 2 uses two cores where one process uses one. Timings on
a shared machine are noisy: compare within one run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import subprocess
import sys
from collections.abc import Iterator
from math import nan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINE = re.compile(r"iteration\s+(\d+)/.*elapsed time per iteration \(ms\): ([0-9.]+) .*?"
                  r"(?:max live tensors \(GiB\): ([0-9.]+)|$)", re.MULTILINE)


def model_flags(seq_length: int, iters: int) -> list[str]:
    return [
        "--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4", "--group-query-attention",
        "--num-query-groups", "2", "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
        "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--seq-length", str(seq_length),
        "--max-position-embeddings", str(seq_length), "--micro-batch-size", "1", "--global-batch-size", "1",
        "--train-iters", str(iters), "--lr", "1e-4", "--mock-data", "--vocab-size", "512", "--log-interval", "1",
        "--eval-iters", "0", "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "1234",
    ]


def run(nproc: int, flags: list[str], allocator_counter: bool = False) -> tuple[float, float]:
    """(median step ms, median peak live GiB) over the iterations after the first; ``allocator_counter``: the peak
    from ``live_tensor_bytes.py``'s allocator counter instead of the profiler's allocation log."""
    script = os.path.join(ROOT, "benchmarks", "live_tensor_bytes.py") if allocator_counter else \
        os.path.join(ROOT, "pretrain_gpt.py")
    command = [os.path.join(ROOT, ".venv", "bin", "torchrun"), "--standalone", f"--nproc_per_node={nproc}", script,
               *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:  # the ranks' error lines, not only torchrun's summary that ends stderr
        errors = "\n".join(line for line in out.stderr.splitlines() if "Error" in line)
        sys.exit(f"{' '.join(command)} failed:\n{out.stdout[-2000:]}{errors[-3000:]}")
    rows = [(float(ms), float(gib or "nan")) for it, ms, gib in LINE.findall(out.stdout) if int(it) > 1]
    return statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)


# ---------------------------------------------------------------- against PyTorch's context parallelism
# One causal attention layer (not a whole model: PyTorch's context parallelism replaces
# F.scaled_dot_product_attention, and our model reaches its cp attention through its own layer) at cp 2 on 2
# processes: q, k, v [b, h, s, d] of the whole sequence drawn from one seed on every rank, each rank keeping its two
# load-balanced chunks (PyTorch's head-tail balancer cuts the same ones). Each side runs forward + backward; the
# sides alternate repeat by repeat after one warm-up call each, and the step time is the slower rank's.


@contextlib.contextmanager
def _ours(whole: list, ps, comm_type: str) -> Iterator[tuple]:
    """This rank's chunks of ``whole`` (q, k, v, output gradient) and our cp attention with ``comm_type``."""
    from megatron_like.model.context_parallel import context_parallel_attention, split_for_context_parallel

    ps.cp_comm_type = comm_type
    yield ([split_for_context_parallel(t, ps.cp_size, ps.cp_rank, dim=2) for t in whole],
           lambda q, k, v: context_parallel_attention(q, k, v, ps))


@contextlib.contextmanager
def _pytorchs(whole: list, ps, rotate: str) -> Iterator[tuple]:
    """The chunks PyTorch's ``context_parallel`` cuts of ``whole`` and SDPA, which it replaces by its ring."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.experimental import context_parallel

    # listed in that module's __all__ and imported from there by torchtitan; not re-exported by the package
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    set_rotate_method(rotate)
    buffers = [t.clone() for t in whole]  # cut in place to this rank's chunks inside the block
    with context_parallel(DeviceMesh.from_group(ps.cp_group, ps.device.type), buffers=buffers,
                          buffer_seq_dims=[2] * len(buffers), no_restore_buffers=set(buffers)):
        yield buffers, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)


SIDES = {"ours p2p": (_ours, "p2p"), "ours all_gather": (_ours, "all_gather"),
         "PyTorch allgather": (_pytorchs, "allgather"), "PyTorch alltoall": (_pytorchs, "alltoall")}


def against_pytorch_worker(args: argparse.Namespace) -> None:
    """Runs on each of the 2 torchrun processes; rank 0 prints the table."""
    import time

    import torch
    import torch.nn.functional as F

    sys.path.insert(0, ROOT)
    from megatron_like import collectives as comm
    from megatron_like.config import ParallelConfig
    from megatron_like.model.context_parallel import split_for_context_parallel
    from megatron_like.parallel_state import ParallelState

    ps = ParallelState.initialize(ParallelConfig(context_parallel_size=2), 2)
    dtype = torch.float32 if ps.device.type == "cpu" else torch.bfloat16  # the fused GPU kernels take 16-bit
    generator = torch.Generator().manual_seed(0)
    shape = (args.batch, args.heads, args.seq_length, args.head_dim)
    whole = [torch.randn(shape, generator=generator).to(ps.device, dtype) for _ in range(4)]  # q, k, v, d out
    leaves = [t.clone().requires_grad_() for t in whole[:3]]
    out = F.scaled_dot_product_attention(*leaves, is_causal=True)
    out.backward(whole[3])
    expected = [split_for_context_parallel(t.detach(), 2, ps.cp_rank, dim=2)
                for t in [out] + [leaf.grad for leaf in leaves]]

    def step(side: str) -> tuple[float, float]:
        """(seconds of the slower rank, largest difference from one process over output and gradients)."""
        setup, option = SIDES[side]
        with setup(whole, ps, option) as ((q, k, v, grad_out), attention):
            local = [t.detach().requires_grad_() for t in (q, k, v)]
            if ps.device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            out = attention(*local)
            out.backward(grad_out)
            if ps.device.type == "cuda":
                torch.cuda.synchronize()
            seconds = torch.tensor([time.perf_counter() - start], device=ps.device)  # NCCL reduces device tensors
        got = [out.detach()] + [t.grad for t in local]
        difference = torch.tensor([max(float((a.float() - b.float()).abs().max()) for a, b in zip(got, expected))],
                                  device=ps.device)
        comm.all_reduce(seconds, ps.cp_group, op="max")
        comm.all_reduce(difference, ps.cp_group, op="max")
        return float(seconds), float(difference)

    running, failed = [], {}
    for side in SIDES:  # warm-up; a side that cannot run on this device says why in one line
        try:
            step(side)
            running.append(side)
        except Exception as error:  # noqa: BLE001 - reported in the table, not raised
            failed[side] = f"{type(error).__name__}: {str(error).splitlines()[0]}"
    times: dict[str, list[float]] = {side: [] for side in running}
    differences = {}
    for _ in range(args.repeats):
        for side in running:
            seconds, differences[side] = step(side)
            times[side].append(seconds)
    if ps.cp_rank != 0:
        return
    tokens = args.batch * args.seq_length
    print(f"causal attention, s = {args.seq_length}, batch {args.batch}, {args.heads} heads of {args.head_dim}, "
          f"{dtype}, cp 2 on 2 processes ({ps.device.type}, {ps.backend}), forward + backward, median of "
          f"{args.repeats}")
    print("| side | step (ms) | tokens/s | vs PyTorch allgather | max abs difference from one process |")
    print("|---|---:|---:|---:|---:|")
    base = statistics.median(times["PyTorch allgather"]) if "PyTorch allgather" in times else None
    for side, values in times.items():
        seconds = statistics.median(values)
        ratio = f"{base / seconds:.2f}x" if base else "-"
        print(f"| {side} | {seconds * 1e3:.1f} | {tokens / seconds:,.0f} | {ratio} | {differences[side]:.1e} |")
    for side, why in failed.items():
        print(f"| {side} | does not run on {ps.device.type}: {why} | | | |")


def against_pytorch(args: argparse.Namespace) -> None:
    command = [os.path.join(ROOT, ".venv", "bin", "torchrun"), "--standalone", "--nproc_per_node=2",
               os.path.abspath(__file__), "--pytorch-worker", "--seq-length", str(args.seq_length),
               "--repeats", str(args.repeats), "--heads", str(args.heads), "--head-dim", str(args.head_dim),
               "--batch", str(args.batch)]
    out = subprocess.run(command, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                         text=True, check=False)
    if out.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    print(out.stdout, end="")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-length", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=4)
    parser.add_argument("--no-memory-log", action="store_true",
                        help="step times only: run without the peak-live log (the profiler), peak column nan")
    parser.add_argument("--memory-log", choices=["profiler", "counter", "both"], default="profiler",
                        help="where the peak live bytes come from: the training log's profiler allocation log, the "
                             "allocator counter of live_tensor_bytes.py (memory that does not grow with the step's "
                             "ops: 32K), or both side by side (to check they agree)")
    parser.add_argument("--layouts", nargs="+", default=["1", "p2p", "all_gather", "a2a"],
                        help="which rows to run: 1 (one process) and cp 2 comm types")
    parser.add_argument("--against-pytorch", action="store_true",
                        help="our cp attention layer against torch.distributed.tensor.experimental.context_parallel")
    parser.add_argument("--repeats", type=int, default=5, help="--against-pytorch: timed steps per side")
    parser.add_argument("--heads", type=int, default=8, help="--against-pytorch: attention heads")
    parser.add_argument("--head-dim", type=int, default=64, help="--against-pytorch: head dimension")
    parser.add_argument("--batch", type=int, default=1, help="--against-pytorch: sequences per step")
    parser.add_argument("--pytorch-worker", action="store_true", help=argparse.SUPPRESS)  # one torchrun process
    args = parser.parse_args()
    if args.pytorch_worker:
        return against_pytorch_worker(args)
    if args.against_pytorch:
        return against_pytorch(args)
    # --no-memory-log: step times without the profiler's per-op allocation log (its cost per op weighs on the cp
    # runs' many attention tiles, and at 32K its log outgrows a 23 GiB machine); peak live is then not measured.
    flags = model_flags(args.seq_length, args.iters) + (["--no-log-memory"] if args.no_memory_log else [])
    if args.memory_log != "profiler":
        import live_tensor_bytes

        live_tensor_bytes.reporter()  # compiled once here, not by both ranks at once
    sources = {"profiler": [False], "counter": [True], "both": [False, True]}[args.memory_log]
    print(f"seq {args.seq_length}, Llama-style 2 layers x hidden 256, 4 heads (2 KV), batch 1, fp32, 1 thread each")
    print(f"{'layout':<22} | {'peak from':>9} | {'step (ms)':>9} | {'vs 1 process':>12} | {'peak live (GiB)':>15} | "
          f"{'vs 1 process':>12}")
    base: dict[bool, tuple[float, float]] = {}
    for layout in args.layouts:
        for counter in sources:
            cp = [] if layout == "1" else ["--context-parallel-size", "2", "--cp-comm-type", layout]
            ms, gib = run(1 if layout == "1" else 2, flags + cp, allocator_counter=counter)
            base_ms, base_gib = base.setdefault(counter, (ms, gib)) if layout == "1" else base.get(counter, (nan,) * 2)
            name = "1 process" if layout == "1" else f"cp 2 {layout}"
            print(f"{name:<22} | {'counter' if counter else 'profiler':>9} | {ms:>9.0f} | {ms / base_ms:>12.2f} | "
                  f"{gib:>15.4f} | {gib / base_gib:>12.2f}", flush=True)


if __name__ == "__main__":
    main()
