"""What the bad-step checks, the rerun mode's bookkeeping and the straggler report cost per training step.

    .venv/bin/python benchmarks/bad_step_cost.py [--trials 3] [--iters 30] [--log-interval 10] [--reps 1000]

Two gloo processes of data parallelism (the layout where the checks add a reduction of their own: without ZeRO
the norm needs none over dp), a small GPT. Each trial runs every variant once, in turn, in one process group:

* ``off``: ``--no-check-for-nan-in-loss-and-grad``;
* ``checks``: the default (the loss and every gradient checked, the verdict agreed by all ranks);
* ``rerun``: ``--rerun-mode validate_results`` (the generators' states and the step's micro batches kept);
* ``straggler``: ``--log-straggler`` on top of the checks (a timer per step, one all-gather per log interval).

The figure is the training log's ``elapsed time per iteration`` of every log interval after the first (the first
holds the optimizer's first step); the table gives each variant's median over trials and its ratio to ``off``.
On a loaded machine those ratios drown in noise, so the pieces the checks and the report add are also timed
alone first (median microseconds per call over ``--reps`` calls, 2 gloo ranks): divide by a step's time.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "128",
         "--max-position-embeddings", "128", "--micro-batch-size", "4", "--global-batch-size", "16"]
VARIANTS = {
    "off": ["--no-check-for-nan-in-loss-and-grad"],
    "checks": [],
    "rerun": ["--rerun-mode", "validate_results"],
    "straggler": ["--log-straggler"],
}
ELAPSED = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")


def run(rank: int, world: int, iters: int, log_interval: int, trials: int) -> dict[str, list[float]]:
    """On every rank: each variant once per trial; ``{variant: [ms per step of each trial]}`` (the last rank's)."""
    from tests.distributed.gpt_runs import train_gpt

    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(trials):
        for name, flags in VARIANTS.items():
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                train_gpt(rank, world, MODEL + flags + ["--train-iters", str(iters),
                                                         "--log-interval", str(log_interval)])
            intervals = [float(ms) for ms in ELAPSED.findall(out.getvalue())][1:]
            if intervals:
                times[name].append(statistics.mean(intervals))
    return times


def parts(rank: int, world: int, reps: int) -> dict[str, float]:
    """On every rank: microseconds per call of each piece the checks and the report add (median of ``reps``)."""
    import time

    import torch

    from megatron_like import collectives as comm
    from megatron_like.training.bad_steps import step_losses
    from megatron_like.training.checkpointing import rng_state

    torch.distributed.init_process_group("gloo")
    group = comm.world_group()
    flag, mine = torch.zeros(1), torch.zeros(1, dtype=torch.float64)
    stats = [{"lm loss": torch.tensor(2.5)} for _ in range(8)]
    pieces = {
        "flag all-reduce over dp (plain dp, per step)": lambda: comm.all_reduce(flag, group, op="max"),
        "loss check (per step)": lambda: bool(torch.isfinite(step_losses(stats)).all()),
        "rng snapshot (rerun mode, per step)": rng_state,
        "timer start + stop (per step)": lambda: (time.perf_counter(), time.perf_counter()),
        "all-gather of the times (per log interval)": lambda: comm.all_gather_along_dim(mine, group, dim=0),
    }
    result = {}
    for name, piece in pieces.items():
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            piece()
            times.append(time.perf_counter() - start)
        result[name] = statistics.median(times) * 1e6
    torch.distributed.destroy_process_group()
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--reps", type=int, default=1000)
    args = parser.parse_args(argv)
    from tests.distributed.harness import run_distributed

    for name, us in run_distributed(parts, 2, args.reps, timeout=600)[0].items():
        print(f"{name:<45} {us:>9.1f} us")

    times = run_distributed(run, 2, args.iters, args.log_interval, args.trials, timeout=3600)[-1]
    base = statistics.median(times["off"])
    print(f"{'variant':<10} {'ms/step (median)':>17} {'vs off':>7}  trials (ms/step)")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:<10} {median:>17.1f} {median / base:>7.3f}  {', '.join(f'{v:.1f}' for v in values)}")


if __name__ == "__main__":
    main()
