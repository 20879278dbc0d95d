"""Which checkpoints stay under ``--save``: ``--keep-last-checkpoints N`` and ``--keep-checkpoint-every M``.

Rank 0 applies the rule right after the tracker names a new checkpoint (both formats; for ``--async-save`` in the
background write, once it is complete), so a deletion never leaves the tracker without a complete checkpoint:
the newest ``N`` iteration directories at or below the tracked iteration stay, and so do the milestones (iterations
that are multiples of ``M``, Orbax's ``keep_period``). Directories above the tracked iteration (a save that was
interrupted after a resume from an older checkpoint) are left alone.

A directory is first renamed to ``iter_XXXXXXX.megatron_like-deleting`` (one atomic step: a loader never meets a
half-deleted checkpoint under its real name), then removed; a leftover of a deletion that was interrupted is removed
by the next one.
"""

from __future__ import annotations

import os
import re
import shutil

ITERATION_DIR = re.compile(r"^iter_(\d{7,})$")
DELETING_SUFFIX = ".megatron_like-deleting"


def saved_iterations(root: str) -> list[int]:
    """The iterations of the ``iter_XXXXXXX`` directories under ``root``, ascending."""
    found = []
    for name in os.listdir(root):
        match = ITERATION_DIR.match(name)
        if match and os.path.isdir(os.path.join(root, name)):
            found.append(int(match.group(1)))
    return sorted(found)


def to_delete(iterations: list[int], tracked: int, keep_last: int, keep_every: int | None) -> list[int]:
    """The iterations the rule deletes: at or below ``tracked``, not among the newest ``keep_last`` of those, not a
    multiple of ``keep_every``."""
    candidates = [i for i in iterations if i <= tracked]
    kept = set(candidates[-keep_last:])
    return [i for i in candidates if i not in kept and not (keep_every and i % keep_every == 0)]


def apply_retention(root: str, tracked: int, keep_last: int | None, keep_every: int | None) -> list[str]:
    """Delete the checkpoints the rule drops once ``tracked`` is named by the tracker; returns the deleted paths
    (nothing without ``keep_last``). Rank 0 only."""
    if keep_last is None:
        return []
    deleted = []
    for name in os.listdir(root):  # the leftovers of an interrupted deletion
        if name.endswith(DELETING_SUFFIX):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    for iteration in to_delete(saved_iterations(root), tracked, keep_last, keep_every):
        path = os.path.join(root, f"iter_{iteration:07d}")
        doomed = path + DELETING_SUFFIX
        os.replace(path, doomed)
        shutil.rmtree(doomed)
        deleted.append(path)
    return deleted


def retain_after_save(root: str, tracked: int, keep_last: int | None, keep_every: int | None) -> None:
    """:func:`apply_retention` that reports a failure in one line and goes on (a checkpoint left behind costs
    space, not the run)."""
    try:
        apply_retention(root, tracked, keep_last, keep_every)
    except OSError as error:
        print(f" > WARNING: could not delete old checkpoints under {root} (--keep-last-checkpoints): {error}",
              flush=True)
