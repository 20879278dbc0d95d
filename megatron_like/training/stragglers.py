"""Slow ranks named: ``--log-straggler`` reports each rank's compute time per step every log interval.

In a synchronous job every rank's *step* time is the slowest rank's (the others wait in the gradient reduction),
so the log line's time names nobody. What differs is the time a rank spends computing before it waits: here the
forward and backward passes of the step (the pipeline schedule), timed on the host on CPU and by CUDA events on
the device's stream on GPU (no host synchronization per step). A rank's collectives *inside* the schedule (tensor
and pipeline parallelism) make its group wait for its slowest member, so a slow rank shows in every rank of its
tensor/pipeline group; across data-parallel replicas, where the gradient reduction comes after the schedule,
it stands alone.

Every log interval one all-gather of one number per rank (the mean over the interval) goes to rank 0, which
prints min / median / max with the slowest ranks and their hosts, and a warning naming each rank above
``--straggler-threshold`` x the median.
"""

from __future__ import annotations

import socket
import statistics
import time

import torch

from megatron_like import collectives as comm
from megatron_like.parallel_state import ParallelState

SLOWEST_SHOWN = 3
"""Ranks named in the report line, slowest first."""
HOST_BYTES = 64
"""Host names are gathered cut to this many bytes."""


class StragglerReport:
    """Times each step's compute on this rank and reports all ranks' times every log interval."""

    def __init__(self, ps: ParallelState, threshold: float) -> None:
        self.ps, self.threshold = ps, threshold
        self.on_cuda = ps.device.type == "cuda"
        self.seconds = 0.0
        self.steps = 0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._started = 0.0
        self.hosts = self._gather_hosts()

    def _gather_hosts(self) -> list[str]:
        """Every rank's host name, by rank (once, at the start)."""
        host = socket.gethostname()
        if not comm.is_initialized():
            return [host]
        # Fixed-width bytes in a tensor: no pickled objects between ranks.
        raw = torch.frombuffer(bytearray(host.encode()[:HOST_BYTES].ljust(HOST_BYTES, b"\0")), dtype=torch.uint8)
        gathered = comm.all_gather_along_dim(raw.reshape(1, HOST_BYTES).to(self.ps.device), comm.world_group(), 0)
        return [bytes(row).rstrip(b"\0").decode(errors="replace") for row in gathered.cpu().tolist()]

    def start(self) -> None:
        """The step's compute begins."""
        if self.on_cuda:
            begin = torch.cuda.Event(enable_timing=True)
            begin.record()
            self._events.append((begin, torch.cuda.Event(enable_timing=True)))
        else:
            self._started = time.perf_counter()

    def stop(self) -> None:
        """The step's compute ends (before its gradient reduction)."""
        if self.on_cuda:
            self._events[-1][1].record()
        else:
            self.seconds += time.perf_counter() - self._started
        self.steps += 1

    def _mean_seconds(self) -> float:
        if self.on_cuda:  # the events of the interval completed long ago: no wait in practice
            self.seconds = sum(begin.elapsed_time(end) for begin, end in self._events) / 1000.0
            self._events = []
        return self.seconds / max(self.steps, 1)

    def report(self, iteration: int) -> list[float]:
        """Gather every rank's mean compute time per step since the last report, print the line (rank 0) and
        restart the count; return the times in seconds, by rank."""
        mine = torch.tensor([self._mean_seconds()], dtype=torch.float64, device=self.ps.device)
        times = comm.all_gather_along_dim(mine, comm.world_group(), dim=0) if comm.is_initialized() else mine
        seconds = times.tolist()
        self.seconds, self.steps = 0.0, 0
        if self.ps.rank == 0:
            for line in self.lines(iteration, seconds):
                print(line, flush=True)
        return seconds

    def lines(self, iteration: int, seconds: list[float]) -> list[str]:
        """The report line and a warning per rank above the threshold, from every rank's seconds per step."""
        median = statistics.median_low(seconds)  # of 2 ranks the faster: a slow one stands out against it
        order = sorted(range(len(seconds)), key=lambda r: -seconds[r])
        slowest = ", ".join(f"rank {r} ({self.hosts[r]}) {seconds[r] * 1e3:.1f}" for r in order[:SLOWEST_SHOWN])
        lines = [f" straggler report at iteration {iteration} | compute time per step (ms) across {len(seconds)} "
                 f"ranks: min {min(seconds) * 1e3:.1f} | median {median * 1e3:.1f} | max {max(seconds) * 1e3:.1f} | "
                 f"slowest: {slowest} |"]
        for rank in order:
            if median > 0 and seconds[rank] > self.threshold * median:
                lines.append(f" > WARNING: straggler: rank {rank} on host {self.hosts[rank]} computes "
                             f"{seconds[rank] / median:.2f}x the median rank's time per step "
                             f"(--straggler-threshold {self.threshold:g})")
        return lines
