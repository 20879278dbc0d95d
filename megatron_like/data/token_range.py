"""The smallest and largest token id of a dataset, read from its ``.bin`` once and cached.

A dataset binarized with another tokenizer (or a NullTokenizer ``--vocab-size`` smaller than the data's
ids) would otherwise be found mid-run, as an ``IndexError`` traceback in the embedding (a device-side
assert on a GPU), or never: with tensor parallelism every rank masks the ids outside its vocabulary
shard, so an id beyond the whole vocabulary embeds as zeros and trains silently, as does an id that
falls into the padding rows. Megatron-LM does not check; a user expects the mistake to be refused
before the job starts, so the launch checks the range of every ``--data-path`` prefix before any
process group exists (``megatron_like/training/preflight.py``).

The scan reads the whole ``.bin`` (0.1-0.2 s per GB from the page cache on this 2-core machine under
load, one thread; from a cold disk, the disk's read speed), so its result is cached as a small JSON
file in the same directory as the sample indices (``--data-cache-path``, default ``<dir of the
prefix>/index-cache``), named by the md5 of the files' paths, sizes and modification times: a later
launch on the same files reads 2 numbers, a rewritten dataset is scanned again.
"""

from __future__ import annotations

import hashlib
import json
import os

from megatron_like.data.indexed_dataset import IndexedDataset, data_file_path, index_file_path


def _file_identity(prefix: str) -> dict:
    """The paths, sizes and modification times that name the cache entry of ``prefix``."""
    identity = {}
    for path in (index_file_path(prefix), data_file_path(prefix)):
        stat = os.stat(path)
        identity[os.path.realpath(path)] = [stat.st_size, stat.st_mtime_ns]
    return identity


def cached_token_id_range(indexed: IndexedDataset, cache_dir: str) -> tuple[int, int]:
    """Return ``indexed.token_id_range()``, from ``cache_dir`` when this exact file was scanned before.

    The entry is written atomically (temporary name, then rename), so ranks that scan the same file at
    the same moment write the same bytes; an unwritable ``cache_dir`` only costs a scan next time.
    """
    identity = _file_identity(indexed.prefix)
    digest = hashlib.md5(json.dumps(identity, sort_keys=True).encode(), usedforsecurity=False).hexdigest()
    path = os.path.join(cache_dir, f"{digest}_token_id_range.json")
    try:
        with open(path) as f:
            entry = json.load(f)
        if entry["files"] == identity:
            return int(entry["smallest"]), int(entry["largest"])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # not cached yet (or an unreadable entry): scan
    smallest, largest = indexed.token_id_range()
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        os.makedirs(cache_dir, exist_ok=True)
        with open(tmp, "w") as f:
            json.dump({"files": identity, "smallest": smallest, "largest": largest}, f)
        os.replace(tmp, path)
    except OSError:
        if os.path.exists(tmp):
            os.remove(tmp)
    return smallest, largest
