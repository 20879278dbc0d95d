"""Workers die with their launcher: no orphan keeps training and writing checkpoints.

torchrun starts each worker in a session of its own, so killing the launcher's process group (``kill -9
-- -PGID``) or the launcher alone leaves the workers running. :func:`die_with_launcher` asks Linux to
send this process SIGKILL when its parent dies (``prctl(PR_SET_PDEATHSIG)``, through ctypes).

Why the kernel's parent-death signal and not a thread polling ``os.getppid()``: it fires at once, also
while the worker is blocked inside a C++ collective, costs nothing, and needs no thread. Why SIGKILL:
the launcher is gone, so nobody would collect a clean exit; checkpoint writes are atomic (a killed save
leaves the previous checkpoint loadable), so dying at once is safe.

It is armed only under torchrun (``TORCHELASTIC_RUN_ID`` in the environment), also with one process: a
process started from a shell (``nohup python pretrain_gpt.py &``) must outlive that shell, and the test
harness's spawned processes already end with their parent. torchrun's elastic agent keeps working: it stops
and restarts workers itself, and it starts them from its main thread (the signal follows the *thread* that
forked). Off Linux it does nothing.

A launcher that died before the signal was armed has left this process to a new parent: init (pid 1), or
the nearest sub-reaper (tini, systemd --user, a container's init), whose pid is anything. So the parent is
compared with the one this module saw when it was imported (the worker's start, before any flag is
parsed), not with 1: a changed parent means the launcher is gone, and the worker exits.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
PARENT_AT_START = os.getppid()
"""The parent when this module was imported: the launcher, for a torchrun worker."""


def die_with_launcher() -> bool:
    """Arm the parent-death signal when launched by torchrun; True when armed.

    A launcher that died before this call already left the process to a new parent (init or a sub-reaper):
    then exit.
    """
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return False
    if os.getppid() != PARENT_AT_START:
        print(f"error: the launcher (pid {PARENT_AT_START}) is gone; exiting", file=sys.stderr, flush=True)
        os._exit(1)
    return True
