"""Peak bytes of live tensors while a function runs, from the torch profiler's allocation log.

Unlike the resident set this counts what tensors hold (glibc's allocator keeps freed memory), so tests can
compare it with the bytes a design promises (ZeRO-3 start-up, chunked weight draws).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from torch.profiler import ProfilerActivity, profile

T = TypeVar("T")


def peak_live_bytes(fn: Callable[[], T]) -> tuple[int, T]:
    """``(peak bytes of tensors alive at once while fn() runs, fn())``: allocations minus frees, in time order."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    alive = peak = 0
    for event in events:
        alive += event.nbytes()
        peak = max(peak, alive)
    return peak, result
