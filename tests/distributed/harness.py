"""The equivalence harness: run a function on N gloo processes and collect what each returns.

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes on 127.0.0.1 with a free TCP
port and torchrun's environment variables (so ``ParallelState.initialize`` works unchanged), one
thread each, and returns ``[fn(rank, world_size, *args) for each rank]``. If a rank raises, the others
are stopped and its traceback is re-raised in the test; a hung run fails after ``timeout`` seconds.
"""

from __future__ import annotations

import os
import queue
import socket
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


def _worker(fn: Callable, rank: int, world_size: int, port: int, results: Any, args: tuple, kwargs: dict) -> None:
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


def start_distributed(fn: Callable, world_size: int, *args: Any, **kwargs: Any) -> tuple[list[Any], Any]:
    """Start ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` processes without waiting: return the
    processes and the queue each puts ``(rank, ok, value)`` on (``run_distributed`` collects it)."""
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    processes = [
        ctx.Process(target=_worker, args=(fn, rank, world_size, port, results, args, kwargs), daemon=True)
        for rank in range(world_size)
    ]
    for p in processes:
        p.start()
    return processes, results


def collect_distributed(processes: list[Any], results: Any, timeout: float = 300.0) -> list[Any]:
    """Wait for the ranks ``start_distributed`` started; return their results in rank order (raise on the first
    failure or when one does not finish within ``timeout`` s). The processes are joined or terminated either way."""
    world_size = len(processes)
    collected: dict[int, Any] = {}
    try:
        while len(collected) < world_size:
            try:
                rank, ok, value = results.get(timeout=timeout)
            except queue.Empty:
                missing = sorted(set(range(world_size)) - set(collected))
                raise AssertionError(f"ranks {missing} did not finish within {timeout:.0f} s") from None
            if not ok:
                raise AssertionError(f"rank {rank} of {world_size} failed:\n{value}")
            collected[rank] = _to_torch(value)
    finally:
        for p in processes:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    return [collected[r] for r in range(world_size)]


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
            for p in processes:
                if p.is_alive():
                    p.terminate()
