"""When a run should stop early: preemption signals, ``--exit-interval`` and ``--exit-duration-in-mins``.

Clusters announce preemption with a signal: SLURM sends SIGTERM (and, with ``sbatch --signal=USR1@120``,
SIGUSR1 two minutes before), torchrun forwards the SIGTERM it receives to its workers. The handler only
records the signal; the loop asks :meth:`ExitConditions.check` after every iteration, which combines
the signal flag and the wall-clock limit of *every* rank with one all-reduce, so all ranks save the same
iteration and leave together (a rank that stopped alone would leave the others waiting in a collective).
A second signal while the first is pending restores the default action and re-raises it: the process
dies at once, as the user asked twice.

Hangs: every collective times out after ``--distributed-timeout-minutes``, but a gloo collective whose
peer was stopped (not killed) was seen to wait past its timeout now and then. A watchdog thread is the
backstop: when no iteration completes for the timeout plus a few seconds, it prints every thread's stack
and exits the process with status 1, so a job never hangs silently.

No healthy phase counts against that per-iteration limit: evaluation beats the watchdog after every batch, and a
checkpoint save (a synchronous write, the waits for a background write, the final save) runs under
:func:`saving`, whose limit is ``--save-timeout-minutes``: a save may take longer than an iteration's limit, a hung
one still ends the run.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from types import FrameType

import torch

from megatron_like import collectives as comm
from megatron_like.config import CheckpointConfig

EXIT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
WATCHDOG_GRACE_SECONDS = 5.0
SAVE_FAILED = "a background checkpoint write failed"


class HangWatchdog:
    """Exits the process (status 1, with all stacks) when :meth:`beat` is not called for ``limit_seconds``, or
    for ``save_limit_seconds`` inside :meth:`saving`.

    It watches only while the function that created it (``pretrain``) is still on its thread's stack, so
    an exception that leaves training (say, in a notebook) never lets it kill the process later.
    """

    def __init__(self, limit_seconds: float, owner: FrameType, save_limit_seconds: float | None = None) -> None:
        self.limit = limit_seconds
        self.save_limit = save_limit_seconds if save_limit_seconds is not None else limit_seconds
        self.phase: str | None = None
        """The checkpoint phase running now (its limit is ``save_limit``), None between them."""
        self.owner_code, self.owner_thread = owner.f_code, threading.get_ident()
        self.last_beat = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)
        self._thread.start()

    def beat(self) -> None:
        """Record progress."""
        self.last_beat = time.monotonic()

    @contextlib.contextmanager
    def saving(self, what: str) -> Iterator[None]:
        """Run a checkpoint phase ``what`` under the save limit; leaving it counts as progress."""
        outer = self.phase
        self.phase = what
        self.beat()
        try:
            yield
        finally:
            self.phase = outer
            self.beat()

    def _owner_running(self) -> bool:
        frame = sys._current_frames().get(self.owner_thread)
        while frame is not None:
            if frame.f_code is self.owner_code:
                return True
            frame = frame.f_back
        return False

    def _watch(self) -> None:
        while not self._stop.wait(min(self.limit / 10.0, 5.0)):
            if not self._owner_running():
                return
            stalled = time.monotonic() - self.last_beat
            phase = self.phase
            if phase is not None and stalled > self.save_limit:
                self._exit(f"error: {phase} took more than {stalled:.0f} s (--save-timeout-minutes): a peer rank "
                           "died or the file system hangs; exiting")
            elif phase is None and stalled > self.limit:
                self._exit(f"error: no training progress for {stalled:.0f} s (--distributed-timeout-minutes plus "
                           f"{WATCHDOG_GRACE_SECONDS:g} s): a peer rank died or hangs; exiting")

    @staticmethod
    def _exit(message: str) -> None:
        print(message, file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        os._exit(1)

    def stop(self) -> None:
        self._stop.set()


_running: HangWatchdog | None = None
"""The watchdog of the training running in this process (one ``pretrain`` at a time), for :func:`saving`."""


def saving(what: str) -> contextlib.AbstractContextManager:
    """``with saving("saving checkpoint at iteration 100"):`` runs a checkpoint phase under --save-timeout-minutes
    instead of the per-iteration limit (nothing to do outside training)."""
    return _running.saving(what) if _running is not None else contextlib.nullcontext()


def beat() -> None:
    """Tell the running training's watchdog that a long phase (an evaluation batch) progresses."""
    if _running is not None:
        _running.beat()


def watchdog_limit() -> float | None:
    """The running watchdog's per-iteration limit in seconds (None without one): ``slow_save`` faults exceed it."""
    return _running.limit if _running is not None else None


class ExitConditions:
    """Decides, identically on every rank, whether training stops after the current iteration."""

    def __init__(self, checkpoint: CheckpointConfig, device: torch.device | None = None,
                 timeout_minutes: float | None = None) -> None:
        global _running
        self.config = checkpoint
        self.device = device or torch.device("cpu")
        self.start_time = time.time()
        self.received: int | None = None
        self._previous: dict[int, object] = {}
        self.watchdog = None
        if timeout_minutes is not None and comm.is_initialized():
            self.watchdog = HangWatchdog(timeout_minutes * 60.0 + WATCHDOG_GRACE_SECONDS, sys._getframe(1),
                                         checkpoint.save_timeout_minutes * 60.0)
            _running = self.watchdog
        if checkpoint.exit_signal_handler:
            for signum in EXIT_SIGNALS:
                try:
                    self._previous[signum] = signal.signal(signum, self._handle)
                except ValueError:  # not the main thread (e.g. a test harness thread): no handler
                    break

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.received is not None:
            self.close()
            signal.raise_signal(signum)
            return
        self.received = signum

    def check(self, iteration: int, save_failed: bool = False) -> str | None:
        """Why to stop after ``iteration`` (the same answer on every rank), or None to go on.

        ``save_failed``: this rank's background checkpoint write failed; every rank then answers
        :data:`SAVE_FAILED` in the same iteration (the caller raises the agreed error)."""
        self.beat()
        c = self.config
        minutes = (time.time() - self.start_time) / 60.0
        flags = torch.tensor([
            float(self.received is not None),
            float(c.exit_duration_in_mins is not None and minutes > c.exit_duration_in_mins),
            float(save_failed),
        ], device=self.device)
        if comm.is_initialized():
            comm.all_reduce(flags, comm.world_group(), op="max")
        if flags[2] > 0:
            return SAVE_FAILED
        if c.exit_interval is not None and iteration % c.exit_interval == 0:
            return f"--exit-interval {c.exit_interval}"
        if flags[0] > 0:
            name = signal.Signals(self.received).name if self.received is not None else "a signal on another rank"
            return f"received {name}"
        if flags[1] > 0:
            return f"--exit-duration-in-mins {c.exit_duration_in_mins}"
        return None

    def beat(self) -> None:
        """Tell the hang watchdog that training progresses."""
        if self.watchdog is not None:
            self.watchdog.beat()

    def close(self) -> None:
        """Stop the watchdog and put back the signal handlers that were installed before."""
        global _running
        if self.watchdog is not None:
            if _running is self.watchdog:
                _running = None
            self.watchdog.stop()
            self.watchdog = None
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}
