"""One job per checkpoint directory: a lock file ``<--save>/job.lock`` naming its owner.

Rank 0 takes the lock after the process groups start and before anything is built; all ranks agree on
the outcome (a second job on the same ``--save`` stops on every rank with one line naming the holder).
The file holds the owner's host, the machine's boot id, its PID namespace, its pid and the process's start
time (``/proc/<pid>/stat``): together they name one process, never a recycled pid. Rules when the file exists:

* held by a live process of this machine and PID namespace: refuse;
* held by a process of this machine and PID namespace that is gone (a killed job, a torchrun restart): a stale
  lock, taken over with a one-line notice;
* held from another host, another boot, or another PID namespace (a container on the same machine, whose pids
  this process cannot check): refuse, naming the holder; delete the file by hand once that job is known to be gone.

Both taking and taking over are atomic, so of several jobs racing for the same directory exactly one wins:

* the lock is created by ``link()``-ing a complete file of this process to ``job.lock`` (fails when it exists:
  never a half-written lock);
* a stale lock is taken over only by the process that creates ``job.lock.takeover-<hash of the stale file>``
  (``O_EXCL``: one creator); it checks that ``job.lock`` still holds those bytes and renames its own file over it.
  The marker stays until the lock is released, so a slower racer that read the same stale file loses.

Taking the lock also removes the leftovers of interrupted saves: the files whose name holds
``.megatron_like-tmp.`` (``checkpointing.write_atomically``), which only this code writes; with the lock held no
other job writes there, and this job has not started saving yet. The lock is released at the end of training, or
at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from megatron_like import collectives as comm
from megatron_like.parallel_state import ParallelState
from megatron_like.training.checkpointing import TEMPORARY_MARK, CheckpointError

LOCK_FILE = "job.lock"
TAKEOVER_ATTEMPTS = 20

before_takeover: Callable[[], None] | None = None
"""Tests set this to run after a process judged the lock stale and before it takes it over (to race processes)."""


class CheckpointDirectoryBusyError(CheckpointError):
    """Another job holds the lock of ``--save``."""


def _start_time(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (Linux), None when unknown or when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]  # field 22; the name in () may hold spaces
    except (OSError, IndexError):
        return None


def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _alive(pid: int, start: str | None) -> bool:
    """Whether process ``pid`` (started at ``start``) still runs in this PID namespace."""
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
    return {"host": socket.gethostname(), "boot": _read_text("/proc/sys/kernel/random/boot_id"),
            "pid_namespace": _pid_namespace(), "pid": pid, "start": _start_time(pid),
            "since": time.strftime("%Y-%m-%d %H:%M:%S")}


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _parse(raw: bytes) -> dict | None:
    try:
        holder = json.loads(raw)
    except ValueError:
        return None
    return holder if isinstance(holder, dict) and isinstance(holder.get("pid"), int) else None


def _read_raw(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def _same_process(holder: dict, me: dict) -> bool:
    return all(holder.get(key) == me[key] for key in ("host", "boot", "pid_namespace", "pid"))


def _holder_is_stale(holder: dict | None, path: str, save: str, me: dict) -> str:
    """The notice of a takeover when ``holder`` is gone; CheckpointDirectoryBusyError when it may live."""
    if holder is None:
        raise CheckpointDirectoryBusyError(f"--save {save} holds a lock file this code did not write ({path}); "
                                           "if no job uses that directory, delete it")
    who = f"pid {holder['pid']} on host {holder.get('host')} (since {holder.get('since')})"
    if holder.get("host") != me["host"]:
        raise CheckpointDirectoryBusyError(
            f"--save {save} is locked by {who}; this host cannot check that process: if that job is gone, delete "
            f"{path}")
    # A file of an older version lacks the boot id and namespace: compared as this machine's.
    if holder.get("boot", me["boot"]) != me["boot"] or holder.get("pid_namespace", me["pid_namespace"]) != \
            me["pid_namespace"]:
        raise CheckpointDirectoryBusyError(
            f"--save {save} is locked by {who} in another boot or PID namespace (a container?), whose processes "
            f"this one cannot check: if that job is gone, delete {path}")
    if _alive(holder["pid"], holder.get("start")):
        raise CheckpointDirectoryBusyError(
            f"--save {save} is in use by another job (pid {holder['pid']} on {holder['host']}, since "
            f"{holder.get('since')}); stop it or pass another --save")
    return (f" > taking over the lock of --save {save} from pid {holder['pid']} on {holder['host']}, "
            "which is no longer running")


def remove_leftover_temporaries(root: str) -> list[str]:
    """Delete the temporary files of interrupted saves under ``root`` (names holding ``.megatron_like-tmp.``, which
    only this code writes); return their paths."""
    removed = []
    for directory, _, files in os.walk(root):
        for name in files:
            # Another job's lock file on its way in (take_lock) is left to that job.
            if TEMPORARY_MARK in name and not (directory == root and name.startswith(LOCK_FILE)):
                path = os.path.join(directory, name)
                os.remove(path)
                removed.append(path)
    return removed


@dataclass
class JobLock:
    """The lock this process holds (rank 0), or an empty one (other ranks, no ``--save``)."""

    path: str | None = None
    notice: str | None = None
    takeover_marker: str | None = None
    """The ``job.lock.takeover-*`` file of the takeover that got this lock: removed with it."""

    def release(self) -> None:
        """Remove the lock file if this process still owns it."""
        if self.path is not None:
            holder = _parse(_read_raw(self.path) or b"")
            if holder is not None and _same_process(holder, _owner()):
                os.remove(self.path)
            if self.takeover_marker is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(self.takeover_marker)
            self.path = None


def _write_own_file(path: str, me: dict) -> str:
    """A complete lock file of this process beside ``path`` (a temporary name), to link or rename into place."""
    own = f"{path}.{me['pid']}{TEMPORARY_MARK}{me['pid']}"
    with open(own, "w") as f:
        json.dump(me, f)
        f.flush()
        os.fsync(f.fileno())
    return own


def _take_over(path: str, own: str, stale: bytes) -> str | None:
    """Rename ``own`` over the stale lock ``path`` when this process wins the takeover; its marker, or None when
    another process took it over first (or the file changed)."""
    if before_takeover is not None:
        before_takeover()
    marker = f"{path}.takeover-{hashlib.sha256(stale).hexdigest()[:16]}"
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        return None
    if _read_raw(path) != stale:  # replaced meanwhile: not the stale lock any more
        os.remove(marker)
        return None
    os.replace(own, path)
    return marker


def take_lock(save: str) -> JobLock:
    """Take ``<save>/job.lock`` for this process (CheckpointDirectoryBusyError when another job holds it)."""
    path = os.path.join(save, LOCK_FILE)
    me = _owner()
    own = _write_own_file(path, me)
    try:
        for _ in range(TAKEOVER_ATTEMPTS):
            try:
                os.link(own, path)
                return _registered(JobLock(path))
            except FileExistsError:
                pass
            stale = _read_raw(path)
            if stale is None:  # released meanwhile: race for it again
                continue
            holder = _parse(stale)
            if holder is not None and _same_process(holder, me):
                return _registered(JobLock(path))  # this process took it before (pretrain called twice)
            notice = _holder_is_stale(holder, path, save, me)
            marker = _take_over(path, own, stale)
            if marker is not None:
                return _registered(JobLock(path, notice, marker))
            time.sleep(0.05)  # another process is taking it over: see who holds it then
        raise CheckpointDirectoryBusyError(f"--save {save}: other jobs keep taking over its lock {path}; stop them or "
                                           "pass another --save")
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(own)


def _registered(lock: JobLock) -> JobLock:
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
