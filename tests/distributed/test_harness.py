"""The harness notices a dead rank at once: a rank that ends without returning (``os._exit``, a signal) fails the
test with its exit status and the end of its output, long before the run's timeout, and its peer, blocked in a
collective or in the rendezvous with it, is killed."""

from __future__ import annotations

import os
import signal
import sys

import pytest
import torch

from megatron_like import collectives as comm
from megatron_like.config import ParallelConfig
from megatron_like.parallel_state import ParallelState
from tests.distributed.harness import collect_distributed, start_distributed

# Far above what noticing a death takes (about a second), far below the 300 s default: a harness that waited
# for the timeout fails with "did not finish", which the assertions below refuse.
TIMEOUT_S = 60


def rank_one_dies(rank: int, world_size: int, how: str) -> None:
    """Rank 1 prints a line, then ends as ``how`` says; rank 0 waits on it in an all-reduce (or the rendezvous)."""
    if rank == 1 and how == "killed before the rendezvous":
        print("rank 1 is about to be killed", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    ps = ParallelState.initialize(ParallelConfig(), world_size)
    if rank == 1:
        # os._exit flushes no Python buffer: the line reaches the log only if the harness made stdout line-buffered
        # (under PYTHONUNBUFFERED it would reach it anyway, hence the flag in the line).
        print(f"rank 1 is about to exit (line-buffered: {sys.stdout.line_buffering})")
        os._exit(3)
    comm.all_reduce(torch.ones(1), ps.dp_group)  # raises or hangs: its peer is gone


@pytest.mark.parametrize("how,status,line", [
    ("os._exit in training", "exited with status 3", "rank 1 is about to exit (line-buffered: True)"),
    ("killed before the rendezvous", "was killed by SIGKILL", "rank 1 is about to be killed"),
])
def test_a_dead_rank_fails_the_run_at_once_with_its_status_and_output(how: str, status: str, line: str) -> None:
    processes, results = start_distributed(rank_one_dies, 2, how)
    with pytest.raises(AssertionError) as failure:
        collect_distributed(processes, results, timeout=TIMEOUT_S)
    message = str(failure.value)
    assert message.startswith(f"rank 1 of 2 {status} without returning"), message
    assert line in message, message
    assert not any(p.is_alive() for p in processes), "the peer blocked on the dead rank was left running"
