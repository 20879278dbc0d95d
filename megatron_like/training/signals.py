"""When a run should stop early: preemption signals, ``--exit-interval`` and ``--exit-duration-in-mins``.

Clusters announce preemption with a signal: SLURM sends SIGTERM (and, with ``sbatch --signal=USR1@120``,
SIGUSR1 two minutes before), torchrun forwards the SIGTERM it receives to its workers. The handler only
records the signal; the loop asks :meth:`ExitConditions.check` after every iteration, which combines
the signal flag and the wall-clock limit of *every* rank with one all-reduce, so all ranks save the same
iteration and leave together (a rank that stopped alone would leave the others waiting in a collective).
A second signal while the first is pending restores the default action and re-raises it: the process
dies at once, as the user asked twice.
"""

from __future__ import annotations

import signal
import time
from types import FrameType

import torch
import torch.distributed as dist

from megatron_like import collectives as comm
from megatron_like.config import CheckpointConfig

EXIT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class ExitConditions:
    """Decides, identically on every rank, whether training stops after the current iteration."""

    def __init__(self, checkpoint: CheckpointConfig, device: torch.device | None = None) -> None:
        self.config = checkpoint
        self.device = device or torch.device("cpu")
        self.start_time = time.time()
        self.received: int | None = None
        self._previous: dict[int, object] = {}
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

    def check(self, iteration: int) -> str | None:
        """Why to stop after ``iteration`` (the same answer on every rank), or None to go on."""
        c = self.config
        if c.exit_interval is not None and iteration % c.exit_interval == 0:
            return f"--exit-interval {c.exit_interval}"
        minutes = (time.time() - self.start_time) / 60.0
        flags = torch.tensor([
            float(self.received is not None),
            float(c.exit_duration_in_mins is not None and minutes > c.exit_duration_in_mins),
        ], device=self.device)
        if dist.is_initialized():
            comm.all_reduce(flags, dist.group.WORLD, op="max")
        if flags[0] > 0:
            name = signal.Signals(self.received).name if self.received is not None else "a signal on another rank"
            return f"received {name}"
        if flags[1] > 0:
            return f"--exit-duration-in-mins {c.exit_duration_in_mins}"
        return None

    def close(self) -> None:
        """Put back the handlers that were installed before."""
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}
