"""Run ``pretrain_gpt.py`` through torchrun and read the ``lm loss`` of every logged iteration."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*\| lm loss: ([0-9.E+-]+) \|")

# The command of the foundation issue's "Done when", without the launcher and the layout flags.
ISSUE_FLAGS = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--max-position-embeddings",
    "32",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--train-iters",
    "6",
    "--lr",
    "1e-3",
    "--mock-data",
    "--vocab-size",
    "512",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--log-interval",
    "1",
    "--seed",
    "1234",
]


def in_process_run(flags: list[str]) -> dict:
    """``train_gpt``'s result for the one-process run of ``flags``, trained in this process: the code and
    flags ``torchrun --nproc_per_node 1`` would run, without starting a launcher and a worker (~10 s each).
    The last two flags put back the command line's defaults that the harness's BASE_FLAGS change."""
    from tests.distributed.gpt_runs import train_gpt

    return train_gpt(0, 1, flags + ["--make-vocab-size-divisible-by", "128", "--adam-eps", "1e-8"])


def in_process_losses(flags: list[str]) -> dict[int, float]:
    """``{iteration: lm loss}`` of :func:`in_process_run`."""
    return dict(enumerate(in_process_run(flags)["losses"], start=1))


def logged_values(stdout: str, name: str) -> dict[int, float]:
    """``{iteration: value}`` of the statistic ``name`` (e.g. ``load_balancing_loss``) on each training log line."""
    pattern = re.compile(rf"iteration\s+(\d+)/\s*\d+ \|.*\| {re.escape(name)}: ([0-9.E+-]+) \|")
    return {int(it): float(value) for it, value in pattern.findall(stdout)}


def torchrun(nproc: int, flags: list[str], script: str = "pretrain_gpt.py", timeout: float = 300) -> str:
    """Launch ``script`` on ``nproc`` CPU processes; return stdout (raise with the output on failure)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        script,
        *flags,
    ]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout)
    if result.returncode != 0:
        raise AssertionError(f"{' '.join(command)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result.stdout


def logged_losses(stdout: str) -> dict[int, float]:
    """``{iteration: lm loss}`` from Megatron log lines."""
    return {int(it): float(loss) for it, loss in LOSS.findall(stdout)}


def run_data_tool(name: str, *args: object, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``data_tools/<name>`` with ``args``; raise with its stderr when ``check`` and it fails."""
    proc = subprocess.run([sys.executable, str(ROOT / "data_tools" / name), *map(str, args)], capture_output=True,
                          text=True, timeout=120)
    if check and proc.returncode != 0:
        raise AssertionError(f"{name} exited {proc.returncode}:\n{proc.stderr}")
    return proc
