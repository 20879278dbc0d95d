"""Fault injection, a test tool: ``--inject-fault KIND@ITER[:RANK]`` makes a run fail on purpose.

Off by default (no ``--inject-fault``, nothing is installed and :func:`should_inject` answers False). The tests
of the resilience features (bad steps, reruns, stragglers, watchdog, restarts) use it to produce the failure a
real cluster produces by chance, at a known iteration on a known rank::

    --inject-fault nan_loss@3          the loss of iteration 3 is NaN on every rank, every time it runs
    --inject-fault nan_grad@3:1        rank 1's gradients of iteration 3 are NaN after their reduction
    --inject-fault transient@3         iteration 3's loss is NaN on its first execution only (a flipped bit)
    --inject-fault loss_spike@3        iteration 3's loss is SPIKE_FACTOR x larger, every time it runs
    --inject-fault slow@2:1            rank 1 sleeps SLOW_SECONDS in every step from iteration 2 on
    --inject-fault hang@3:1            rank 1 stops making progress at the start of iteration 3 (the watchdog ends it)
    --inject-fault dead@4:1            rank 1 dies (SIGKILL) at the start of iteration 4
    --inject-fault save_fail@2:1       rank 1's write of the checkpoint of iteration 2 fails (OSError EIO)
    --inject-fault slow_save@2         the write of iteration 2's checkpoint outlasts the per-iteration watchdog limit

``ITER`` is the 1-based number of the training iteration (the one the log line prints); ``RANK`` the global
rank, every rank when left out. The flag repeats. Each kind's rule is one row of :data:`KINDS`: the code that
fails asks ``should_inject(kind, iteration, rank)`` at the point where that failure would happen.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass

from megatron_like.config.errors import ConfigError


@dataclass(frozen=True)
class FaultKind:
    """When a fault of one kind fires."""

    description: str
    """What the fault does, for --help and error messages."""
    from_iteration_on: bool = False
    """Fires at ITER and every iteration after it (else at ITER only)."""
    once: bool = False
    """Fires on the first execution of ITER only: a rerun of that iteration is clean (a non-reproducible fault).
    It also never fires after a launcher restart (TORCHELASTIC_RESTART_COUNT > 0), as a real transient fault
    does not come back with the job."""


KINDS: dict[str, FaultKind] = {
    "nan_loss": FaultKind("the loss is NaN on that iteration, every time it runs (a bad batch)"),
    "nan_grad": FaultKind("the rank's gradients are NaN after their reduction, every time the iteration runs"),
    "transient": FaultKind("the loss is NaN on the first execution of that iteration only (a flipped bit)",
                           once=True),
    "loss_spike": FaultKind("the loss is SPIKE_FACTOR x its value on that iteration, every time it runs"),
    "slow": FaultKind("the rank sleeps SLOW_SECONDS in each step from that iteration on (a straggler)",
                      from_iteration_on=True),
    # Saves, hangs and restarts (docs/checkpoints.md "Preemption and faults"). hang and dead fire in the first
    # torchrun attempt only: the restarted workers pass the same flags and must get past that iteration.
    "hang": FaultKind("the rank stops making progress at the start of that iteration (a hung collective)", once=True),
    "dead": FaultKind("the rank dies (SIGKILL to itself) at the start of that iteration", once=True),
    "save_fail": FaultKind("the rank's write of that iteration's checkpoint fails (OSError EIO)"),
    "slow_save": FaultKind("the rank's write of that iteration's checkpoint takes SLOW_SAVE_EXCESS_SECONDS longer "
                           "than the hang watchdog's per-iteration limit"),
}
"""Every kind of fault, by the name ``--inject-fault`` takes."""

SPIKE_FACTOR = 1000.0
"""What a ``loss_spike`` multiplies the loss by: far above any --loss-spike-factor."""
SLOW_SECONDS = 0.2
"""How long a ``slow`` rank sleeps per step: several times a tiny test model's step on a loaded CPU."""
SLOW_SAVE_EXCESS_SECONDS = 3.0
"""How much longer than the watchdog's per-iteration limit a ``slow_save`` write takes."""


@dataclass(frozen=True)
class FaultSpec:
    """One ``--inject-fault KIND@ITER[:RANK]``."""

    kind: str
    """A key of KINDS."""
    iteration: int
    """The 1-based training iteration the fault fires at (or from)."""
    rank: int | None = None
    """The global rank that fails; None: every rank."""


def parse_fault(text: str) -> FaultSpec:
    """``"nan_grad@3:1"`` -> ``FaultSpec("nan_grad", 3, 1)``; a ConfigError (one line) for anything else."""
    usage = f"--inject-fault {text!r} is not KIND@ITER[:RANK] with KIND one of {', '.join(KINDS)}, e.g. nan_loss@3:0"
    kind, at, rest = text.partition("@")
    iteration_text, _, rank_text = rest.partition(":")
    if not at or kind not in KINDS or not iteration_text.isdigit() or (rank_text and not rank_text.isdigit()):
        raise ConfigError(usage)
    if int(iteration_text) < 1:
        raise ConfigError(f"--inject-fault {text!r}: iterations count from 1")
    return FaultSpec(kind, int(iteration_text), int(rank_text) if rank_text else None)


_installed: list[FaultSpec] = []
_fired: set[FaultSpec] = set()


def install_faults(specs: Iterable[FaultSpec | str]) -> None:
    """Replace the faults this process injects by ``specs`` (parsed when given as text); ``[]`` removes all."""
    global _installed
    _installed = [spec if isinstance(spec, FaultSpec) else parse_fault(spec) for spec in specs]
    _fired.clear()


def installed_faults() -> list[FaultSpec]:
    """The faults :func:`install_faults` installed (empty: injection is off)."""
    return list(_installed)


def _first_attempt() -> bool:
    """True unless a launcher restarted this job (torchrun counts its restarts in TORCHELASTIC_RESTART_COUNT)."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


def should_inject(kind: str, iteration: int, rank: int) -> bool:
    """Whether the code about to run iteration ``iteration`` on global rank ``rank`` fails with ``kind`` now.

    A ``once`` kind counts this call as its one execution: ask exactly once per execution of the step.
    """
    if not _installed:
        return False
    rule = KINDS[kind]
    for spec in _installed:
        if spec.kind != kind or (spec.rank is not None and spec.rank != rank):
            continue
        if not (iteration >= spec.iteration if rule.from_iteration_on else iteration == spec.iteration):
            continue
        if rule.once:
            if spec in _fired or not _first_attempt():
                continue
            _fired.add(spec)
        return True
    return False


def step_faults(iteration: int, rank: int) -> None:
    """Fire the faults due at the start of training ``iteration`` on ``rank`` (``dead``, ``hang``)."""
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
