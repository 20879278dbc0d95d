"""The hang watchdog (``training/signals.py``): a checkpoint phase runs under its own limit, a stall outside one
ends the process with status 1, and the ``hang`` fault is such a stall. Each case runs in a forked process, which
the watchdog may end."""

from __future__ import annotations

import multiprocessing
import sys
import time

from megatron_like.training import signals
from megatron_like.training.fault_injection import FaultSpec, install_faults, step_faults

LIMIT, SAVE_LIMIT = 0.5, 3.0


def watched(body_name: str) -> None:
    """In a fork: run ``BODIES[body_name]`` under a watchdog of a 0.5 s iteration limit and a 3 s save limit."""
    signals._running = signals.HangWatchdog(LIMIT, sys._getframe(), SAVE_LIMIT)
    BODIES[body_name]()
    signals._running.stop()
    sys.exit(0)


def slow_save() -> None:
    with signals.saving("saving the checkpoint of iteration 1"):
        time.sleep(3 * LIMIT)


def stall() -> None:
    time.sleep(3 * LIMIT)


def injected_hang() -> None:
    install_faults([FaultSpec("hang", 2, 0)])
    step_faults(1, 0)  # not due
    step_faults(2, 0)


BODIES = {"slow_save": slow_save, "stall": stall, "injected_hang": injected_hang}


def exit_statuses(body_names: list[str]) -> list[int]:
    """Each body in its own forked process, all at once (they mostly sleep): the processes' exit statuses."""
    processes = [multiprocessing.get_context("fork").Process(target=watched, args=(name,)) for name in body_names]
    for process in processes:
        process.start()
    for process in processes:
        process.join(60)
        if process.exitcode is None:
            process.kill()
            process.join()
    return [process.exitcode for process in processes]


def test_a_save_longer_than_the_iteration_limit_completes_and_a_stall_or_hang_ends_the_process():
    assert exit_statuses(["slow_save", "stall", "injected_hang"]) == [0, 1, 1]
