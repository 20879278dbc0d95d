"""No healthy job killed, no failed save left to the timeout (docs/checkpoints.md "Preemption and faults").

* ``save_fail`` on rank 1 (``--inject-fault save_fail@2:1``): every rank stops with the same one line naming rank 1,
  long before ``--distributed-timeout-minutes`` (5 here; the harness gives up after 3), in the three ways a save
  runs: the torch format, torch_dist, torch_dist in the background (``--async-save``).
* ``slow_save`` on every rank, 3 s longer than the hang watchdog's per-iteration limit: a synchronous save in the
  middle of the run and the final background write both complete (the watchdog would end the process, status 1).
  The limit is the timeout plus a grace of 1 s here (5 s in training) to keep the sleeps short.
  The two run in two process groups at once: their ranks sleep through the slow saves, which then overlap.
"""

from __future__ import annotations

import os

from megatron_like.training.checkpointing import CheckpointError, latest_iteration
from tests.distributed.gpt_runs import train_gpt
from tests.distributed.harness import run_distributed, run_distributed_together

SMALL = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--global-batch-size", "4",
         "--save-interval", "2"]
SAVE_WAYS = {"torch": ["--ckpt-format", "torch"], "torch_dist": [], "async": ["--async-save"]}


def failing_saves(rank: int, world_size: int, root: str) -> dict[str, str | None]:
    """Each way of saving with rank 1's save of iteration 2 failing: the error this rank stopped with."""
    stopped = {}
    for name, way in SAVE_WAYS.items():
        flags = SMALL + way + ["--train-iters", "4", "--save", os.path.join(root, name), "--inject-fault",
                               "save_fail@2:1", "--distributed-timeout-minutes", "5"]
        try:
            train_gpt(rank, world_size, flags)
            stopped[name] = None
        except CheckpointError as error:
            stopped[name] = str(error)
    return stopped


def test_a_save_failing_on_one_rank_stops_every_rank_at_once_with_one_line(tmp_path):
    results = run_distributed(failing_saves, 2, str(tmp_path), timeout=180)
    for name in SAVE_WAYS:
        messages = {rank_result[name] for rank_result in results}
        assert len(messages) == 1, f"{name}: the ranks stopped differently: {messages}"
        [message] = messages
        assert message is not None, f"{name}: the failed save went unnoticed"
        assert "\n" not in message and "failed on rank 1" in message and "injected" in message, message
        assert latest_iteration(str(tmp_path / name)) is None, f"{name}: the tracker names a failed save"


def slow_save(rank: int, world_size: int, save: str, way: list[str], fault: str) -> int | None:
    """A run whose save hit by ``fault`` is slow: the iteration the tracker names at the end."""
    from megatron_like.training import signals

    # 0.1 minutes and a grace of 1 s (5 by default; this rank's own process): the watchdog's per-iteration limit is
    # 6 + 1 s, each slow save takes 10 s. A healthy iteration of this model takes well under a second.
    signals.WATCHDOG_GRACE_SECONDS = 1.0
    train_gpt(rank, world_size, SMALL + way + ["--train-iters", "3", "--save", save, "--inject-fault", fault,
                                               "--distributed-timeout-minutes", "0.1"])
    return latest_iteration(save)


def test_a_save_longer_than_the_watchdog_limit_completes(tmp_path):
    # A slow synchronous save mid-run and a slow final background write, in two process groups at once: each
    # rank sleeps through its 10 s save, so the two waits overlap.
    runs = {"sync": ([], "slow_save@2"), "async": (["--async-save"], "slow_save@3")}
    results = run_distributed_together([(slow_save, 2, str(tmp_path / name), way, fault)
                                        for name, (way, fault) in runs.items()], timeout=240)
    assert dict(zip(runs, results)) == {"sync": [3, 3], "async": [3, 3]}
    assert (tmp_path / "sync" / "iter_0000002" / "common.pt").exists()  # the slow one, complete
