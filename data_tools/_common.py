"""Shared helpers of the data tools: import path, input discovery, jsonl reading, progress lines.

No torch here: the tools stay light.
"""

from __future__ import annotations

import glob
import gzip
import io
import os
import sys
import time
from collections.abc import Iterator

try:
    import megatron_like  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz")


def resolve_inputs(spec: str) -> list[str]:
    """Return the input files of ``--input``: a file, a glob, or a directory (its jsonl files, sorted)."""
    if os.path.isdir(spec):
        files = sorted(
            os.path.join(root, name)
            for root, _, names in os.walk(spec)
            for name in names
            if name.endswith(JSONL_SUFFIXES)
        )
    elif os.path.isfile(spec):
        files = [spec]
    else:
        files = sorted(p for p in glob.glob(spec, recursive=True) if os.path.isfile(p))
    if not files:
        raise FileNotFoundError(f"--input {spec}: no file, directory of .jsonl(.gz) files, or glob match")
    return files


def input_files_or_exit(spec: str) -> list[str]:
    """``resolve_inputs(spec)`` for a tool's ``main``: a bad ``--input`` prints one line and exits 1."""
    try:
        return resolve_inputs(spec)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(1) from None


def open_binary(path: str) -> io.BufferedIOBase:
    """Return the file opened for binary reading, decompressed when it ends in .gz."""
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    return open(path, "rb")  # noqa: SIM115 - the caller closes it


def open_text_out(path: str) -> io.TextIOBase:
    """Return ``path`` opened for writing UTF-8 text, gzip-compressed when it ends in .gz."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if path.endswith(".gz"):
        return gzip.open(path, "wt", encoding="utf-8")
    return open(path, "w", encoding="utf-8")  # noqa: SIM115 - the caller closes it


def iter_lines(path: str, start: int = 0, end: int | None = None, first_line: int = 1) -> Iterator[tuple[int, bytes]]:
    """Yield (line number, raw line without newline) of ``path`` from byte ``start`` up to ``end``.

    ``start`` must be at a line start; a line that starts before ``end`` is read whole. Numbers start
    at ``first_line`` (the number of the line at ``start``). Gzip files are read whole.
    """
    with open_binary(path) as f:
        if start:
            f.seek(start)
        position = start
        line_no = first_line
        for raw in f:
            if end is not None and position >= end:
                break
            position += len(raw)
            yield line_no, raw.rstrip(b"\r\n")
            line_no += 1


def iter_json_docs(paths: list[str]) -> Iterator[tuple[str, int, bytes]]:
    """Yield (file, line number, raw line) over every input file in order."""
    for path in paths:
        for line_no, raw in iter_lines(path):
            yield path, line_no, raw


class Progress:
    """Prints a progress line every ``interval`` documents: docs/s, MB/s, tokens/s (to stderr)."""

    def __init__(self, interval: int, label: str = "", stream=None) -> None:
        self.interval = max(1, interval)
        self.label = label
        self.stream = stream or sys.stderr
        self.start = time.perf_counter()
        self.docs = self.bytes = self.tokens = 0
        self._next = self.interval

    def update(self, docs: int, nbytes: int, tokens: int = 0) -> None:
        """Add counts and print a line when another ``interval`` documents have passed."""
        self.docs += docs
        self.bytes += nbytes
        self.tokens += tokens
        if self.docs >= self._next:
            self._next = (self.docs // self.interval + 1) * self.interval
            self.print()

    def rates(self) -> tuple[float, float, float, float]:
        """Return (elapsed s, docs/s, MB/s, tokens/s)."""
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        return elapsed, self.docs / elapsed, self.bytes / elapsed / 1e6, self.tokens / elapsed

    def print(self) -> None:
        """Print the current totals and rates."""
        elapsed, dps, mbps, tps = self.rates()
        print(
            f"{self.label}processed {self.docs} documents in {elapsed:.1f} s "
            f"({dps:.1f} docs/s, {mbps:.2f} MB/s, {tps:.0f} tokens/s)",
            file=self.stream,
            flush=True,
        )


def ordered_map(fn, items, workers: int, initializer=None, initargs: tuple = ()):
    """Yield ``fn(item)`` for each item in order; ``workers`` processes, at most ``2 * workers`` in flight.

    Unlike ``Pool.imap`` (whose feeder thread reads the whole input ahead), this keeps memory bounded.
    With ``workers <= 1`` everything runs in this process.
    """
    import multiprocessing
    from collections import deque

    if workers <= 1:
        if initializer is not None:
            initializer(*initargs)
        for item in items:
            yield fn(item)
        return
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    with ctx.Pool(workers, initializer=initializer, initargs=initargs) as pool:
        pending: deque = deque()
        for item in items:
            pending.append(pool.apply_async(fn, (item,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def batched(iterable, size: int):
    """Yield lists of up to ``size`` consecutive items."""
    batch = []
    for item in iterable:
        batch.append(item)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch
