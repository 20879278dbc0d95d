"""Process-wide settings a training run applies once at start-up: glibc keeps the memory a CPU step frees.

A CPU step frees its activations and allocates them again in the next step. By default glibc hands large freed
blocks back to the system (buffers of 128 KiB and more live in their own ``mmap``; free memory at the top of
the heap is trimmed once it passes a threshold that glibc adapts upwards to at most 64 MiB), so every step
page-faults the same memory in again: hundreds of thousands of minor faults per step at the benchmark sizes
(docs/performance.md). A GPU's caching allocator keeps freed blocks for the next step; :func:`keep_freed_memory`
makes glibc do the same through ``mallopt``: blocks up to 32 MiB come from the heap, and the heap is trimmed only
when more than 1 GiB of it is free. Larger blocks still get their own ``mmap`` (32 MiB is the most glibc allows
on 64-bit). The cost is resident memory: what one step freed stays with the process, up to its peak.

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
M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameter: blocks of at least this many bytes get their own ``mmap``."""
KEPT_MMAP_THRESHOLD = 32 << 20
"""32 MiB: the largest ``M_MMAP_THRESHOLD`` glibc accepts on 64-bit (half its heap size)."""
KEPT_TRIM_THRESHOLD = 1 << 30
"""1 GiB: freed heap memory up to this much stays with the process."""


@dataclass(frozen=True)
class FreedMemorySetting:
    """What :func:`keep_freed_memory` did to this process's C allocator."""

    kept: bool
    """True when glibc now keeps freed memory (both ``mallopt`` calls succeeded)."""
    reason: str
    """One line for the log: the thresholds set, or why nothing was set."""


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
    elif libc.mallopt(M_MMAP_THRESHOLD, KEPT_MMAP_THRESHOLD) == 1 and \
            libc.mallopt(M_TRIM_THRESHOLD, KEPT_TRIM_THRESHOLD) == 1:
        setting = FreedMemorySetting(True, f"glibc keeps freed memory (blocks up to {KEPT_MMAP_THRESHOLD >> 20} MiB "
                                           f"from the heap, trimmed above {KEPT_TRIM_THRESHOLD >> 30} GiB free; "
                                           "--no-keep-freed-memory turns it off)")
    else:
        setting = FreedMemorySetting(False, "glibc refused mallopt(M_MMAP_THRESHOLD / M_TRIM_THRESHOLD): "
                                            "its default trimming stays")
    _applied = setting
    return setting
