"""Fault behaviour of real ``pretrain_gpt.py`` processes.

* A rank that hangs (SIGSTOP) or dies (SIGKILL) makes the other one exit non-zero within
  ``--distributed-timeout-minutes`` instead of waiting forever. The two ranks are started as plain
  processes with torchrun's environment variables: torchrun itself would tear the job down on a death
  and hide what the ranks do on their own.
* SIGTERM to one rank (what SLURM and torchrun send on preemption) makes *every* rank save the same
  iteration and exit 0, and the next run with the same ``--save``/``--load`` resumes from it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.distributed.harness import free_port
from tests.e2e.cli import ROOT


def gpt_flags(train_iters: int = 100000) -> list[str]:
    """A tiny model that trains ``train_iters`` iterations (by default: until stopped)."""
    return ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
            "--micro-batch-size", "1", "--train-iters", str(train_iters), "--mock-data", "--vocab-size", "128",
            "--log-interval", "1", "--eval-iters", "0", "--make-vocab-size-divisible-by", "8"]


TIMEOUT_MINUTES = 0.1  # 6 s


def launch(flags: list[str], world_size: int = 2) -> list[subprocess.Popen]:
    """Start ``world_size`` ranks of pretrain_gpt.py (stdout+stderr merged, line-buffered)."""
    port = free_port()
    ranks = []
    for rank in range(world_size):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "RANK": str(rank), "LOCAL_RANK": str(rank),
               "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size)}
        ranks.append(subprocess.Popen([sys.executable, "pretrain_gpt.py", *flags], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return ranks


def wait_for_line(process: subprocess.Popen, needle: str, timeout: float = 120.0) -> list[str]:
    """Read ``process``'s output until a line contains ``needle``; return the lines read."""
    lines, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            raise AssertionError(f"process ended before {needle!r}:\n{''.join(lines)}")
        lines.append(line)
        if needle in line:
            return lines
    raise AssertionError(f"no {needle!r} within {timeout} s:\n{''.join(lines)}")


def finish(process: subprocess.Popen, timeout: float) -> tuple[int, str]:
    """Wait for ``process`` to exit (at most ``timeout`` s, else kill it); return (code, rest of output)."""
    try:
        out, _ = process.communicate(timeout=timeout)
        return process.returncode, out
    except subprocess.TimeoutExpired:
        process.kill()
        out, _ = process.communicate()
        return None, out


def test_hung_or_dead_rank_makes_the_other_exit_nonzero_within_the_timeout():
    flags = gpt_flags() + ["--distributed-timeout-minutes", str(TIMEOUT_MINUTES)]
    for fault in (signal.SIGSTOP, signal.SIGKILL):
        rank0, rank1 = launch(flags)
        try:
            wait_for_line(rank1, "iteration        3/")  # the last rank prints the log
            start = time.monotonic()
            os.kill(rank0.pid, fault)
            code, out = finish(rank1, timeout=TIMEOUT_MINUTES * 60 + 30)
            waited = time.monotonic() - start
        finally:
            for process in (rank0, rank1):
                if process.poll() is None:
                    process.kill()
                    process.communicate()
        assert code is not None, f"{fault.name}: the surviving rank hung:\n{out[-3000:]}"
        assert code != 0, f"{fault.name}: the surviving rank exited 0:\n{out[-3000:]}"
        assert waited < TIMEOUT_MINUTES * 60 + 25, f"{fault.name}: took {waited:.1f} s"


def test_sigterm_to_one_rank_saves_on_every_rank_then_exits_cleanly_and_resumes(tmp_path):
    save = str(tmp_path / "checkpoints")
    layout = ["--save", save, "--load", save, "--tensor-model-parallel-size", "2"]
    rank0, rank1 = launch(gpt_flags() + layout)
    try:
        wait_for_line(rank1, "iteration        3/")
        os.kill(rank0.pid, signal.SIGTERM)  # rank 1 never sees the signal: the all-reduce tells it
        code1, out1 = finish(rank1, timeout=60)
        code0, out0 = finish(rank0, timeout=30)
    finally:
        for process in (rank0, rank1):
            if process.poll() is None:
                process.kill()
                process.communicate()
    assert code0 == 0 and code1 == 0, f"rank 0 exited {code0}, rank 1 {code1}:\n{out0[-2000:]}\n{out1[-2000:]}"
    assert "(received SIGTERM)" in out0 or "(received a signal on another rank)" in out0
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as f:
        saved = int(f.read())
    assert f" > saved checkpoint at iteration {saved} to {save}" in out0
    assert os.path.exists(os.path.join(save, f"iter_{saved:07d}", "mp_rank_01_000", "model_optim_rng.pt"))

    # The same command (as `torchrun --max-restarts` would rerun it) resumes where the signal left off.
    resumed = launch(gpt_flags(saved + 2) + layout)
    outs = [finish(p, timeout=120) for p in resumed]
    assert all(code == 0 for code, _ in outs), outs[0][1][-2000:] + outs[1][1][-2000:]
    assert f" > loaded checkpoint from {save} at iteration {saved}" in outs[0][1]
    assert f"iteration {saved + 2:8d}/{saved + 2:8d}" in outs[1][1]
