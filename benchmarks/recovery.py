"""Recovery from a killed rank, local copies against the persistent checkpoint, and what the local copy costs a step.

Each recovery run is one ``torchrun --standalone --nproc_per_node 2 --max-restarts 1`` job of a GPT (default: 4
layers, hidden 512, ~17M parameters with Adam state: ~200 MB of state per rank) whose rank 1 kills itself at the start
of iteration ``--kill-at`` (``--inject-fault dead@K:1``). The recovery time is wall time from that rank's last line
(" > injected fault: ...") to the log line of iteration K in the restarted job: torchrun noticing the death and
stopping the other worker, starting both again (interpreter, imports, process group, model), reading the state,
and redoing the iterations the restored state lacks. Modes:

* ``local``: ``--local-checkpoint-interval 1`` (no persistent checkpoint before K);
* ``persistent-1``: ``--save-interval 1``, a torch_dist checkpoint every iteration (what local copies would replace);
* ``persistent-N``: ``--save-interval N`` (default 5): the restart also redoes the iterations since the last save.

The per-step cost of the local copy: the mean "elapsed time per iteration" of iterations 3..K-1 with
``--local-checkpoint-interval 1`` against a run without it (and without saves), from the same recovery runs.
Timings on a shared machine are noisy; each mode runs ``--trials`` times and the median is reported.

    .venv/bin/python benchmarks/recovery.py [--trials 2] [--kill-at 9] [--hidden-size 512]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ELAPSED = re.compile(r"iteration\s+(\d+)/\s*\d+ \| .*elapsed time per iteration \(ms\): ([0-9.]+)")


def model_flags(args: argparse.Namespace) -> list[str]:
    return ["--num-layers", "4", "--hidden-size", str(args.hidden_size), "--num-attention-heads", "8",
            "--seq-length", "128", "--micro-batch-size", "2", "--global-batch-size", "4", "--mock-data",
            "--vocab-size", "8192", "--train-iters", str(args.kill_at + 2), "--log-interval", "1", "--eval-iters", "0",
            "--num-workers", "0"]


def run(args: argparse.Namespace, extra: list[str], kill: bool) -> tuple[float | None, dict[int, float]]:
    """One torchrun job; (seconds from the death to iteration K after the restart or None, {iteration: ms})."""
    save = tempfile.mkdtemp(prefix="recovery_bench_", dir=args.dir)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "--max-restarts", "1", "pretrain_gpt.py", *model_flags(args), "--save", save, "--load", save, *extra]
    if kill:
        command += ["--inject-fault", f"dead@{args.kill_at}:1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                               text=True)
    died, recovered, elapsed = None, None, {}
    for line in process.stdout:
        if "injected fault" in line:
            died = time.monotonic()
        match = ELAPSED.search(line)
        if match:
            iteration = int(match.group(1))
            if died is None:
                elapsed[iteration] = float(match.group(2))
            elif iteration == args.kill_at and recovered is None:
                recovered = time.monotonic() - died
    process.wait()
    subprocess.run(["rm", "-rf", save], check=False)
    if process.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {process.returncode}")
    return recovered, elapsed


def steady_ms(elapsed: dict[int, float], kill_at: int) -> float:
    return statistics.mean(ms for it, ms in elapsed.items() if 3 <= it < kill_at)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--kill-at", type=int, default=9)
    parser.add_argument("--save-interval", type=int, default=5)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--dir", default=None, help="where the persistent checkpoints go (default: the temp dir)")
    args = parser.parse_args()
    modes = {"local": ["--local-checkpoint-interval", "1", "--save-interval", "1000"],
             "persistent-1": ["--save-interval", "1"],
             f"persistent-{args.save_interval}": ["--save-interval", str(args.save_interval)]}
    recovery: dict[str, list[float]] = {mode: [] for mode in modes}
    step: dict[str, list[float]] = {"no copy": [], "local copy": []}
    for _ in range(args.trials):  # alternating, so a slow period of the machine hits every mode
        for mode, extra in modes.items():
            seconds, elapsed = run(args, extra, kill=True)
            recovery[mode].append(seconds)
            if mode == "local":
                step["local copy"].append(steady_ms(elapsed, args.kill_at))
        _, elapsed = run(args, ["--save-interval", "1000"], kill=False)
        step["no copy"].append(steady_ms(elapsed, args.kill_at))
    print(f"kill at iteration {args.kill_at}, hidden {args.hidden_size}, {args.trials} trial(s), medians:")
    for mode, values in recovery.items():
        print(f"  recovery {mode:>14}: {statistics.median(values):6.1f} s  (trials: "
              f"{', '.join(f'{v:.1f}' for v in values)})")
    plain, local = statistics.median(step["no copy"]), statistics.median(step["local copy"])
    print(f"  step without a local copy: {plain:7.1f} ms; with one every iteration: {local:7.1f} ms "
          f"(+{local - plain:.1f} ms, {100 * (local - plain) / plain:+.0f}%)")


if __name__ == "__main__":
    main()
