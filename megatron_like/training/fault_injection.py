"""Fault injection, a test tool: ``--inject-fault KIND@ITER[:RANK]`` (repeatable; off by default).

Each fault fires once, at iteration ``ITER`` (the iteration being trained or saved), on global rank ``RANK`` or on
every rank when ``:RANK`` is left out. The tests of docs/checkpoints.md "Preemption and faults" use it to prove that
each failure is caught; a production run never passes it.

A fault that kills or stops a process fires only in the first attempt of a ``torchrun --max-restarts`` job
(``TORCHELASTIC_RESTART_COUNT`` 0): the restarted workers pass the same flags and must get past that iteration.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

from megatron_like.config import ConfigError


@dataclass(frozen=True)
class FaultSpec:
    """One fault: what, at which iteration, on which global rank (None: every rank)."""

    kind: str
    iteration: int
    rank: int | None = None


# ------------------------------------------------------------------------------------------------------------------
# The kinds of the resilience work on saves, hangs and restarts (docs/checkpoints.md "Preemption and faults")
# ------------------------------------------------------------------------------------------------------------------
RECOVERY_KINDS = {
    "hang": "the rank stops making progress at the start of the iteration (a hung collective): the watchdog ends it",
    "dead": "the rank dies (SIGKILL to itself) at the start of the iteration; first attempt only",
    "save_fail": "writing the rank's part of the checkpoint of the iteration fails (OSError EIO)",
    "slow_save": "the rank's checkpoint write of the iteration takes 3 s longer than the hang watchdog's "
                 "per-iteration limit",
}
ONCE_PER_JOB = ("hang", "dead")
"""Kinds that fire only in the first torchrun attempt (the restarted workers must get past them)."""
# ------------------------------------------------------------------------------------------------------------------

SLOW_SAVE_EXCESS_SECONDS = 3.0
KINDS = {**RECOVERY_KINDS}

_installed: list[FaultSpec] = []


def parse_fault(text: str) -> FaultSpec:
    """``KIND@ITER[:RANK]`` -> FaultSpec; a one-line ConfigError naming the rule otherwise."""
    kind, at, where = text.partition("@")
    iteration, _, rank = where.partition(":")
    if kind not in KINDS or not at or not iteration.isdigit() or (rank and not rank.isdigit()):
        raise ConfigError(f"--inject-fault {text} is not KIND@ITER[:RANK] with KIND one of {', '.join(KINDS)}, "
                          "ITER an iteration and RANK a global rank (e.g. dead@3:1)")
    return FaultSpec(kind, int(iteration), int(rank) if rank else None)


def install_faults(specs: list[FaultSpec]) -> None:
    """Make ``specs`` the faults of this process (replacing any installed before)."""
    _installed[:] = specs


def should_inject(kind: str, iteration: int, rank: int) -> bool:
    """Whether a fault of ``kind`` is due at ``iteration`` on global ``rank``."""
    if kind in ONCE_PER_JOB and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return False
    return any(s.kind == kind and s.iteration == iteration and s.rank in (None, rank) for s in _installed)


def step_faults(iteration: int, rank: int) -> None:
    """Fire the faults due at the start of training ``iteration`` on ``rank`` (``hang``, ``dead``)."""
    if should_inject("dead", iteration, rank):
        print(f" > injected fault: rank {rank} dies at iteration {iteration}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if should_inject("hang", iteration, rank):
        print(f" > injected fault: rank {rank} hangs at iteration {iteration}", flush=True)
        while True:
            time.sleep(1.0)


def save_faults(iteration: int, rank: int, watchdog_limit_seconds: float | None) -> None:
    """Fire the faults due while ``rank`` writes the checkpoint of ``iteration`` (``slow_save``, ``save_fail``)."""
    if should_inject("slow_save", iteration, rank) and watchdog_limit_seconds is not None:
        time.sleep(watchdog_limit_seconds + SLOW_SAVE_EXCESS_SECONDS)
    if should_inject("save_fail", iteration, rank):
        raise OSError(5, "Input/output error (injected by --inject-fault save_fail)")
