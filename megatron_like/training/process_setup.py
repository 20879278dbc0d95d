"""Process-wide settings a training run applies once at start-up: glibc keeps the memory a CPU step frees.

A CPU step frees its activations and allocates them again in the next step. By default glibc hands large freed
blocks back to the system (blocks of 128 KiB and more, up to an adaptive 32 MiB, and every larger one, get their
own ``mmap``, unmapped when freed; free memory at the top of the heap is trimmed past an adaptive threshold of
at most 64 MiB), so every step page-faults the same memory in again: 500 k minor faults per step, 2 GiB of
fresh pages, at benchmarks/keep_freed_memory.py's issue sizes, where the logits of one micro batch are 51 MiB.
A GPU's caching allocator keeps freed blocks for the next step; :func:`keep_freed_memory` makes glibc do the
same through ``mallopt``: no block gets its own ``mmap`` (``M_MMAP_MAX`` 0: every block comes from the heap,
whatever its size), and the heap is trimmed only when more than 1 GiB at its top is free. Raising the mmap
threshold instead is not enough: glibc caps it at 32 MiB, below the logits. The cost is resident memory: what
a step freed stays with the process for the next one (docs/training.md gives the figures).

The setting is process-wide and cannot be undone (glibc has no call that restores its adaptive defaults), so
it is made once, by ``pretrain()``, for CPU runs only (``--no-keep-freed-memory`` skips it). Elsewhere than
glibc (macOS, musl) it is a no-op that says so.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

M_TRIM_THRESHOLD = -1
"""glibc's ``mallopt`` parameter: free memory at the top of the heap above this many bytes goes back to the OS."""
M_MMAP_MAX = -4
"""glibc's ``mallopt`` parameter: how many blocks may have their own ``mmap`` at once (0: none)."""
KEPT_TRIM_THRESHOLD = 1 << 30
"""1 GiB: freed heap memory up to this much stays with the process."""


@dataclass(frozen=True)
class FreedMemorySetting:
    """What :func:`keep_freed_memory` did to this process's C allocator."""

    kept: bool
    """True when glibc now keeps freed memory (both ``mallopt`` calls succeeded)."""
    reason: str
    """One line for the log: what was set, or why nothing was."""


_applied: FreedMemorySetting | None = None


def applied_setting() -> FreedMemorySetting | None:
    """Return what the last :func:`keep_freed_memory` call did in this process (None: never called)."""
    return _applied


def _glibc() -> ctypes.CDLL | None:
    """Return the process's C library when it is glibc (it has ``gnu_get_libc_version``), else None."""
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt") else None


def keep_freed_memory(enabled: bool, device: torch.device) -> FreedMemorySetting:
    """Make glibc keep the memory a CPU run frees (``enabled`` and ``device`` on CPU); return what was done.

    ``enabled`` is ``--keep-freed-memory`` (on by default); on other devices the host allocator is left as it is
    (activations live on the device, whose caching allocator already keeps them).
    """
    global _applied
    libc = _glibc() if enabled and device.type == "cpu" else None
    if not enabled:
        setting = FreedMemorySetting(False, "glibc's default trimming (--no-keep-freed-memory)")
    elif device.type != "cpu":
        setting = FreedMemorySetting(False, f"glibc's default trimming (the activations live on {device.type})")
    elif libc is None:
        setting = FreedMemorySetting(False, "the C library is not glibc: its own trimming left as it is")
    elif libc.mallopt(M_MMAP_MAX, 0) == 1 and libc.mallopt(M_TRIM_THRESHOLD, KEPT_TRIM_THRESHOLD) == 1:
        setting = FreedMemorySetting(True, "glibc keeps freed memory (every block from the heap, trimmed above "
                                           f"{KEPT_TRIM_THRESHOLD >> 30} GiB free; --no-keep-freed-memory: off)")
    else:
        setting = FreedMemorySetting(False, "glibc refused mallopt(M_MMAP_MAX / M_TRIM_THRESHOLD): its default "
                                            "trimming stays")
    _applied = setting
    return setting
