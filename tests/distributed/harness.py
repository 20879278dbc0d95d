"""The equivalence harness: run a function on N gloo processes and collect what each returns.

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes on 127.0.0.1 with a free TCP
port and torchrun's environment variables (so ``ParallelState.initialize`` works unchanged), one
thread each, and returns ``[fn(rank, world_size, *args) for each rank]``. If a rank raises, the others
are stopped and its traceback is re-raised in the test. If a rank dies without returning (a crash, ``os._exit``,
a signal), the test fails within about a second of its death with its exit code and the tail of its output, and
the other ranks (possibly blocked in a collective with it) are killed. A hung run fails after ``timeout`` seconds.
Each rank's stdout and stderr go to a log file of its own, read back only to report a failure.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _to_numpy(value: Any) -> Any:
    """Tensors cross the process boundary as numpy arrays: shared-memory tensors die with their process."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    if isinstance(value, dict):
        return {k: _to_numpy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_numpy(v) for v in value)
    return value


def _to_torch(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    if isinstance(value, dict):
        return {k: _to_torch(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_torch(v) for v in value)
    return value


def _worker(fn: Callable, rank: int, world_size: int, port: int, results: Any, args: tuple, kwargs: dict,
            log_path: str) -> None:
    with open(log_path, "w") as log:  # the descriptors below keep it open
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    # Line by line: a rank that ends in os._exit (or a crash) leaves no Python buffer to flush.
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    try:
        value = fn(rank, world_size, *args, **kwargs)
        results.put((rank, True, _to_numpy(value)))
    except BaseException:  # noqa: BLE001 - every failure must reach the test
        results.put((rank, False, traceback.format_exc()))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


# Ranks start from a fork server that has imported torch and the trainer once: a spawned rank spent ~3 s of
# CPU importing them, over a thousand rank starts per suite on 2 cores. The server never runs a torch op
# (no thread pool to fork), and each rank still gets a fresh process with its own process group.
# torch._dynamo (with sympy) too: every rank imports it on its first torch.optim optimizer (add_param_group is
# wrapped in torch._disable_dynamo, which imports it), ~1.5 s of CPU per rank; importing it starts no thread.
_PRELOAD = ["torch", "torch._dynamo", "numpy", "megatron_like.training", "megatron_like.inference",
            "tests.distributed.gpt_runs"]


def _context() -> mp.context.BaseContext:
    """The fork-server context, its server started with this process's current environment."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


_LOG_DIR: str | None = None


def _log_dir() -> str:
    """This test process's directory of rank logs (removed at its exit)."""
    global _LOG_DIR
    if _LOG_DIR is None:
        _LOG_DIR = tempfile.mkdtemp(prefix="harness-ranks-")
        atexit.register(shutil.rmtree, _LOG_DIR, True)
    return _LOG_DIR


def start_distributed(fn: Callable, world_size: int, *args: Any, **kwargs: Any) -> tuple[list[Any], Any]:
    """Start ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` processes without waiting: return the
    processes and the queue each puts ``(rank, ok, value)`` on (``run_distributed`` collects it). Each process's
    ``log_path`` names the file its stdout and stderr go to."""
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    processes = []
    for rank in range(world_size):
        log_path = os.path.join(_log_dir(), f"port{port}-rank{rank}.log")
        p = ctx.Process(target=_worker, args=(fn, rank, world_size, port, results, args, kwargs, log_path),
                        daemon=True)
        p.log_path = log_path
        processes.append(p)
    for p in processes:
        p.start()
    return processes, results


def output_tail(process: Any, lines: int = 40) -> str:
    """The last ``lines`` lines a harness rank wrote to its stdout and stderr."""
    try:
        with open(process.log_path, errors="replace") as f:
            text = f.read()
    except OSError:
        return "(no output file)"
    return "\n".join(text.splitlines()[-lines:]) or "(no output)"


def _describe_exit(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


# A rank whose process ended is reported dead once its result has had this long to arrive: a rank's result is in
# the queue's pipe before its process ends (its feeder thread is joined at exit), so the next read finds it.
_RESULT_GRACE_S = 0.5
_POLL_S = 0.1


def _dead_ranks(processes: list[Any], collected: dict[int, Any], ended_at: dict[int, float]) -> list[int]:
    """Ranks whose process ended more than the grace period ago without a result (``ended_at`` remembers when each
    was first seen ended)."""
    now = time.monotonic()
    dead = []
    for rank, p in enumerate(processes):
        if rank in collected or p.exitcode is None:
            continue
        if now - ended_at.setdefault(rank, now) >= _RESULT_GRACE_S:
            dead.append(rank)
    return dead


def _death_report(processes: list[Any], rank: int) -> str:
    p = processes[rank]
    return (f"rank {rank} of {len(processes)} {_describe_exit(p.exitcode)} without returning (the other ranks "
            f"were stopped); the end of its output:\n{output_tail(p)}")


def _stop(processes: list[Any]) -> None:
    """Kill the ranks still running (a rank blocked in a collective ignores nothing but SIGKILL reliably)."""
    for p in processes:
        if p.is_alive():
            p.kill()
    for p in processes:
        p.join(timeout=5)


def collect_distributed(processes: list[Any], results: Any, timeout: float = 300.0) -> list[Any]:
    """Wait for the ranks ``start_distributed`` started; return their results in rank order. Raise on the first
    rank that raised, or died without a result (within a second of its death), or when one does not finish
    within ``timeout`` s; the other ranks are killed then. The processes are joined either way."""
    world_size = len(processes)
    collected: dict[int, Any] = {}
    ended_at: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    finished = False
    try:
        while len(collected) < world_size:
            try:
                rank, ok, value = results.get(timeout=_POLL_S)
            except queue.Empty:
                dead = _dead_ranks(processes, collected, ended_at)
                if dead:
                    raise AssertionError(_death_report(processes, dead[0])) from None
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(collected))
                    raise AssertionError(f"ranks {missing} did not finish within {timeout:.0f} s") from None
                continue
            if not ok:
                raise AssertionError(_failure_report(processes, results, collected, ended_at, rank, value))
            collected[rank] = _to_torch(value)
        finished = True
    finally:
        if finished:
            for p in processes:
                p.join(timeout=10)
        _stop(processes)
        for p in processes:  # read already, if a failure needed them
            with contextlib.suppress(OSError):
                os.remove(p.log_path)
    return [collected[r] for r in range(world_size)]


def _failure_report(processes: list[Any], results: Any, collected: dict[int, Any], ended_at: dict[int, float],
                    rank: int, error: str) -> str:
    """The message for rank ``rank``'s exception. A peer's death makes a rank's collective with it raise, so the
    other ranks get two grace periods to report: one found dead meanwhile is reported as the cause."""
    world_size = len(processes)
    reported = f"rank {rank} of {world_size} failed:\n{error}"
    heard = {rank}  # ranks whose result or error arrived: not dead
    deadline = time.monotonic() + 2 * _RESULT_GRACE_S
    while time.monotonic() < deadline and len(heard | set(collected)) < world_size:
        with contextlib.suppress(queue.Empty):
            heard.add(results.get(timeout=_POLL_S)[0])
        dead = [r for r in _dead_ranks(processes, collected, ended_at) if r not in heard]
        if dead:
            return f"{_death_report(processes, dead[0])}\n\nthen {reported}"
    return reported


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 300.0, **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` processes; return their results.

    Ranks see the environment of the first call (the fork server's): set variables before the suite starts.
    """
    return collect_distributed(*start_distributed(fn, world_size, *args, **kwargs), timeout=timeout)


def run_distributed_together(calls: list[tuple], timeout: float = 300.0) -> list[list[Any]]:
    """``[run_distributed(fn, world_size, *args) for fn, world_size, *args in calls]``, every group started at once
    (each with its own port): for runs that mostly wait (a sleep, a timeout), whose waits then overlap."""
    started = [start_distributed(fn, world_size, *args) for fn, world_size, *args in calls]
    try:
        return [collect_distributed(*group, timeout=timeout) for group in started]
    finally:
        for processes, _ in started:  # a group left behind by another's failure
            _stop(processes)
