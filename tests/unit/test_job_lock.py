"""The lock of ``--save`` (``training/job_lock.py``): an atomic takeover of a stale lock, a holder in another PID
namespace left alone, only this code's temporaries cleaned up; and the launcher guard's check of its parent."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys

import pytest

from megatron_like.training import job_lock
from megatron_like.training.job_lock import (
    LOCK_FILE,
    CheckpointDirectoryBusyError,
    _owner,
    remove_leftover_temporaries,
    take_lock,
)

RACERS = 4


def dead_pid() -> int:
    """The pid of a process that has ended (reaped)."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def stale_holder(**changes: object) -> dict:
    """A lock file's content naming a process of this machine and namespace that is gone."""
    return {**_owner(), "pid": dead_pid(), "start": "1", "since": "then", **changes}


def write_lock(save: str, holder: dict) -> None:
    with open(os.path.join(save, LOCK_FILE), "w") as f:
        json.dump(holder, f)


def race_for_the_lock(save: str, judged: multiprocessing.Barrier, done: multiprocessing.Barrier, index: int) -> None:
    """In a forked racer: judge the lock stale, wait for every racer to have judged it, take it over; stay alive
    until every racer knows its outcome (a winner that is gone would leave a stale lock again)."""
    waited = []

    def wait_once() -> None:  # a loser that comes back while the winner is still renaming does not wait again
        if not waited:
            waited.append(True)
            judged.wait()

    job_lock.before_takeover = wait_once
    try:
        take_lock(save)
        outcome = "won"
    except CheckpointDirectoryBusyError as busy:
        outcome = str(busy)
    with open(os.path.join(save, f"outcome.{index}"), "w") as f:
        f.write(outcome)
    done.wait()
    os._exit(0)  # keep the lock file as it is (no atexit release) for the test to read


def test_exactly_one_of_several_processes_racing_for_a_stale_lock_wins(tmp_path):
    save = str(tmp_path)
    write_lock(save, stale_holder())
    context = multiprocessing.get_context("fork")
    judged, done = context.Barrier(RACERS, timeout=60), context.Barrier(RACERS, timeout=60)
    racers = [context.Process(target=race_for_the_lock, args=(save, judged, done, i)) for i in range(RACERS)]
    for racer in racers:
        racer.start()
    for racer in racers:
        racer.join(120)
    outcomes = [(tmp_path / f"outcome.{i}").read_text() for i in range(RACERS)]
    winners = [racer.pid for racer, outcome in zip(racers, outcomes) if outcome == "won"]
    assert len(winners) == 1, outcomes
    with open(os.path.join(save, LOCK_FILE)) as f:
        assert json.load(f)["pid"] == winners[0]
    assert all("is in use by another job" in outcome for outcome in outcomes if outcome != "won"), outcomes


def test_a_holder_in_another_pid_namespace_or_boot_is_not_taken_over(tmp_path):
    save = str(tmp_path)
    for other in ({"pid_namespace": "pid:[1]"}, {"boot": "another-boot-id"}):
        write_lock(save, stale_holder(**other))
        with pytest.raises(CheckpointDirectoryBusyError, match="another boot or PID namespace .* delete "):
            take_lock(save)
    write_lock(save, stale_holder())  # the same pid, gone, in this namespace: stale
    lock = take_lock(save)
    assert "taking over the lock" in lock.notice
    lock.release()
    assert not os.path.exists(os.path.join(save, LOCK_FILE)) and os.listdir(save) == []


def test_cleanup_removes_only_the_temporaries_this_code_writes(tmp_path):
    shard = tmp_path / "iter_0000001"
    shard.mkdir()
    ours = shard / "__0_0.distcp.megatron_like-tmp.4242"
    theirs = [shard / "notes.tmp.4242", tmp_path / "dataset.idx.tmp.17"]
    for path in [ours, *theirs]:
        path.write_bytes(b"x")
    assert remove_leftover_temporaries(str(tmp_path)) == [str(ours)]
    assert all(path.exists() for path in theirs)


def exit_status_of_die_with_launcher(parent_now: int) -> int:
    """In a fork: arm the launcher guard as a torchrun worker whose parent is now ``parent_now``; its exit status
    (0: it went on)."""
    def child() -> None:
        from megatron_like import launcher_guard

        os.environ["TORCHELASTIC_RUN_ID"] = "test"
        launcher_guard.PARENT_AT_START = os.getppid()
        os.getppid = lambda: parent_now
        launcher_guard.die_with_launcher()
        os._exit(0)

    process = multiprocessing.get_context("fork").Process(target=child)
    process.start()
    process.join(60)
    return process.exitcode


def test_a_worker_whose_launcher_died_before_the_guard_was_armed_exits_also_under_a_sub_reaper():
    assert exit_status_of_die_with_launcher(os.getpid()) == 0  # the launcher (here: the test) still runs
    # Reparented to a sub-reaper (tini, systemd --user): its pid is not 1.
    assert exit_status_of_die_with_launcher(os.getpid() + 1 if os.getpid() != 1 else 2) == 1
