"""Does glibc keeping freed memory pay on CPU? ``pretrain_gpt.py`` with and without ``--no-keep-freed-memory``.

Per step (after warm-up steps): wall seconds, the process's CPU seconds (all threads: gloo's too), minor page
faults; per run: peak resident set (``ru_maxrss``) and the resident set left when training ends (what the
kept memory costs). Single process and pp 2 under ``torchrun``; the two sides alternate in every trial, and
their order flips from trial to trial, so a slow period of the shared machine hits both. Each run is a fresh
process (glibc's setting is process-wide); it runs ``pretrain_gpt.main`` through this file's ``--child`` mode,
which only reads the clocks at the first micro batch of the first timed step and when ``pretrain()`` returns.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/keep_freed_memory.py [--sizes demo issue] [--trials 3]

``demo`` is scripts/demo.sh's model (4 layers, hidden 128, seq 128, vocab 512, 4 micro batches of 4);
``issue`` is benchmarks/parallel_overhead.py's ``--issue-sizes`` (6 layers, hidden 512, seq 256, vocab 50304,
8 micro batches of 1).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMON = ["--mock-data", "--hidden-dropout", "0.0", "--attention-dropout", "0.0", "--lr", "1e-4",
          "--log-interval", "1000", "--eval-interval", "1000", "--eval-iters", "0", "--no-log-memory"]
SIZES = {
    "demo": ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
             "--max-position-embeddings", "128", "--vocab-size", "512", "--micro-batch-size", "4",
             "--global-batch-size", "16"],
    "issue": ["--num-layers", "6", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "256",
              "--max-position-embeddings", "256", "--vocab-size", "50304", "--micro-batch-size", "1",
              "--global-batch-size", "8"],
}
LAYOUTS = {"single": [], "pp2": ["--pipeline-model-parallel-size", "2"]}
SIDES = {"kept": [], "defaults": ["--no-keep-freed-memory"]}


def usage() -> dict[str, float]:
    """This process's clocks and counters now."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return {"wall": time.perf_counter(), "cpu": time.process_time(), "faults": r.ru_minflt}


def resident_mib() -> float:
    """The resident set now, MiB (``/proc/self/statm``: pages)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def child(warmup: int, micro_batches: int, flags: list[str]) -> None:
    """Run ``pretrain_gpt.main(flags)``; print this rank's per-step figures after ``warmup`` steps as JSON."""
    sys.path.insert(0, ROOT)
    import pretrain_gpt

    calls, marks = [0], {}
    forward_step, pretrain = pretrain_gpt.forward_step, pretrain_gpt.pretrain

    def counted_forward_step(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - passes through
        if calls[0] == warmup * micro_batches:
            marks["begin"] = usage()
        calls[0] += 1
        return forward_step(*args, **kwargs)

    def timed_pretrain(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - passes through
        result = pretrain(*args, **kwargs)
        marks["end"], marks["resident"] = usage(), resident_mib()
        return result

    pretrain_gpt.forward_step, pretrain_gpt.pretrain = counted_forward_step, timed_pretrain
    pretrain_gpt.main(flags)
    steps = int(flags[flags.index("--train-iters") + 1]) - warmup
    begin, end = marks["begin"], marks["end"]
    print("RESULT " + json.dumps({
        "rank": int(os.environ.get("RANK", "0")),
        **{key: (end[key] - begin[key]) / steps for key in ("wall", "cpu", "faults")},
        "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "resident_mib": marks["resident"],
    }), flush=True)


def run(size: str, layout: str, side: str, iters: int, warmup: int) -> list[dict]:
    """One fresh run; every rank's figures."""
    flags = COMMON + SIZES[size] + LAYOUTS[layout] + SIDES[side] + ["--train-iters", str(iters)]
    micro = SIZES[size]
    micro_batches = int(micro[micro.index("--global-batch-size") + 1]) // int(micro[micro.index("--micro-batch-size")
                                                                                     + 1])
    me = [os.path.abspath(__file__), "--child", str(warmup), str(micro_batches), "--"] + flags
    if layout == "single":
        command = [sys.executable] + me
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"] + me
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in done.stdout.splitlines() if "RESULT " in line]
    return sorted(results, key=lambda r: r["rank"])


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        child(int(argv[1]), int(argv[2]), argv[4:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", choices=SIZES, default=list(SIZES))
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--iters", type=int, default=6, help="steps per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)
    if args.iters <= args.warmup:
        parser.error(f"--iters {args.iters} must exceed --warmup {args.warmup}")
    print(f"# {args.trials} trials, {args.iters - args.warmup} timed steps per run after {args.warmup}, "
          f"load average {os.getloadavg()[0]:.1f}")
    print("| sizes | layout | glibc | s/step | CPU s/step (max rank) | minor faults/step (max rank) "
          "| peak RSS MiB (max rank) | RSS at end MiB | kept / defaults: s | CPU |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for size in args.sizes:
        for layout in args.layouts:
            trials: dict[str, list[list[dict]]] = {side: [] for side in SIDES}
            for trial in range(args.trials):
                for side in (list(SIDES) if trial % 2 == 0 else list(SIDES)[::-1]):
                    trials[side].append(run(size, layout, side, args.iters, args.warmup))
            medians = {side: {key: statistics.median(max(rank[key] for rank in ranks) for ranks in runs)
                              for key in ("wall", "cpu", "faults", "peak_mib", "resident_mib")}
                       for side, runs in trials.items()}
            for side, m in medians.items():
                ratio = (f"{m['wall'] / medians['defaults']['wall']:.3f} | "
                         f"{m['cpu'] / medians['defaults']['cpu']:.3f}") if side == "kept" else " | "
                print(f"| {size} | {layout} | {side} | {m['wall']:.3f} | {m['cpu']:.3f} | {m['faults']:.0f} | "
                      f"{m['peak_mib']:.0f} | {m['resident_mib']:.0f} | {ratio} |", flush=True)
    print(f"# load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
