"""One job per checkpoint directory: a lock file ``<--save>/job.lock`` naming its owner.

Rank 0 takes the lock after the process groups start and before anything is built; all ranks agree on
the outcome (a second job on the same ``--save`` stops on every rank with one line naming the holder).
The file holds the owner's host, pid and process start time (``/proc/<pid>/stat``, so a recycled pid is
not mistaken for the owner). Rules when the file exists:

* held by a live process on this host: refuse;
* held by a process on this host that is gone (killed job, crashed node restarted): a stale lock, taken
  over with a one-line notice;
* held from another host: this host cannot tell whether that process lives, so refuse, naming the host
  and pid; delete the file by hand once that job is known to be gone.

Taking the lock also removes the leftovers of interrupted saves (``*.tmp.<pid>`` files, see
``checkpointing.write_atomically``): with the lock held no other job writes there, and this job has not
started saving yet. The lock is released at the end of training, or at exit.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import socket
import time
from dataclasses import dataclass

from megatron_like import collectives as comm
from megatron_like.parallel_state import ParallelState
from megatron_like.training.checkpointing import CheckpointError

LOCK_FILE = "job.lock"
_TEMPORARY = re.compile(r"\.tmp\.\d+$")


class CheckpointDirectoryBusyError(CheckpointError):
    """Another job holds the lock of ``--save``."""


def _start_time(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (Linux), None when unknown or when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]  # field 22; the name in () may hold spaces
    except (OSError, IndexError):
        return None


def _alive(pid: int, start: str | None) -> bool:
    """Whether process ``pid`` (started at ``start``) still runs on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by another user
    now = _start_time(pid)
    return start is None or now is None or now == start


def _owner() -> dict:
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "start": _start_time(pid),
            "since": time.strftime("%Y-%m-%d %H:%M:%S")}


def _read(path: str) -> dict | None:
    try:
        with open(path) as f:
            holder = json.load(f)
        return holder if isinstance(holder, dict) and isinstance(holder.get("pid"), int) else None
    except (OSError, ValueError):
        return None


def remove_leftover_temporaries(root: str) -> list[str]:
    """Delete the ``*.tmp.<pid>`` files of interrupted saves under ``root``; return their paths."""
    removed = []
    for directory, _, files in os.walk(root):
        for name in files:
            if _TEMPORARY.search(name):
                path = os.path.join(directory, name)
                os.remove(path)
                removed.append(path)
    return removed


@dataclass
class JobLock:
    """The lock this process holds (rank 0), or an empty one (other ranks, no ``--save``)."""

    path: str | None = None
    notice: str | None = None

    def release(self) -> None:
        """Remove the lock file if this process still owns it."""
        if self.path is not None:
            holder = _read(self.path)
            if holder is not None and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
                os.remove(self.path)
            self.path = None


def take_lock(save: str) -> JobLock:
    """Take ``<save>/job.lock`` for this process (CheckpointDirectoryBusyError when another job holds it)."""
    path = os.path.join(save, LOCK_FILE)
    me, notice = _owner(), None
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
    except FileExistsError:
        holder = _read(path)
        if holder is None:
            notice = f" > replacing the unreadable lock file {path}"
        elif holder["pid"] == me["pid"] and holder.get("host") == me["host"]:
            pass  # this process took it before (pretrain called twice in one process)
        elif holder.get("host") != me["host"]:
            raise CheckpointDirectoryBusyError(
                f"--save {save} is locked by pid {holder['pid']} on host {holder.get('host')} (since "
                f"{holder.get('since')}); this host cannot check that process: if that job is gone, delete "
                f"{path}") from None
        elif _alive(holder["pid"], holder.get("start")):
            raise CheckpointDirectoryBusyError(
                f"--save {save} is in use by another job (pid {holder['pid']} on {holder['host']}, since "
                f"{holder.get('since')}); stop it or pass another --save") from None
        else:
            notice = (f" > taking over the lock of --save {save} from pid {holder['pid']} on {holder['host']}, "
                      "which is no longer running")
        tmp = f"{path}.{me['pid']}"
        with open(tmp, "w") as f:
            json.dump(me, f)
        os.replace(tmp, path)
    lock = JobLock(path, notice)
    atexit.register(lock.release)
    return lock


def hold_checkpoint_directory(save: str | None, ps: ParallelState) -> JobLock:
    """Rank 0 takes the lock of ``save`` and removes leftover temporaries; every rank gets the same
    verdict (call on all ranks together). Raises CheckpointDirectoryBusyError everywhere when refused."""
    lock, error = JobLock(), None
    if save and ps.rank == 0:
        try:
            lock = take_lock(save)
            removed = remove_leftover_temporaries(save)
            if lock.notice:
                print(lock.notice, flush=True)
            if removed:
                print(f" > removed {len(removed)} temporary file(s) of interrupted saves under {save}", flush=True)
        except CheckpointDirectoryBusyError as busy:
            error = str(busy)
        except OSError as failure:
            error = f"cannot take the lock of --save {save}: {failure}"
    agreed = comm.first_error(error, comm.world_group(), ps.device)
    if agreed is not None:
        lock.release()
        raise CheckpointDirectoryBusyError(agreed)
    return lock
