"""What a checkpoint's bytes must prove before they are used: no code runs, no file outside the checkpoint
is opened, no corrupt byte is loaded (docs/checkpoints.md, "What is checked").

* ``.metadata``, torch.distributed.checkpoint's index, is a pickle. :func:`read_dcp_metadata` unpickles it
  with an allow-list of exactly the classes DCP's metadata is made of (plus torch sizes, dtypes and
  layouts, DCP's memory-format enum and the pathlib path of the saved checkpoint id), then checks its
  structure: every storage file it names must be a plain ``.distcp`` name inside the iteration directory.
  Every torch_dist read goes through it; DCP gets the vetted index, never the file.
* :func:`check_storage_files`: every file the index names exists and holds every byte range it points to.
* Checksums. ``torch.save`` writes every record of its zip archive with a CRC-32, which ``torch.load`` never
  checks. Both formats are made of such archives (a torch-format file is one, and so is each piece of a
  ``.distcp`` file), so every saved piece carries its checksum: :func:`verify_archive` checks a whole
  archive, :class:`SavedArchive` one record read straight into its destination. An archive saved with
  ``torch.serialization.set_crc32_options(False)`` has all CRCs zero: it loads unverified, with a notice.
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
import stat
import struct
import zipfile
import zlib
from typing import IO, Any

import torch

from megatron_like.training.checkpointing import DCP_METADATA, TRACKER_FILE, CheckpointError

EARLIER = f"write an earlier saved iteration into {TRACKER_FILE}"
_CHUNK = 4 << 20  # bytes per read while checking a whole archive


# --------------------------------------------------------------------------------------------------
# .metadata: a restricted unpickler
# --------------------------------------------------------------------------------------------------


class _RefusedError(Exception):
    """A global the index may not reference (the name is the message)."""


def _layout(name: str) -> torch.layout:
    """``torch.serialization._get_layout``: how a pickle names ``torch.strided``; only torch layouts."""
    value = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(value, torch.layout):
        raise _RefusedError(f"torch.serialization._get_layout({name!r})")
    return value


def _allowed_globals() -> dict[tuple[str, str], Any]:
    """``(module, name) -> object`` of everything a DCP index may reference (DCP imported here: only runs
    that read torch_dist pay for it)."""
    from torch.distributed.checkpoint import filesystem, metadata, planner

    classes = [metadata.Metadata, metadata.TensorStorageMetadata, metadata.BytesStorageMetadata,
               metadata.ChunkStorageMetadata, metadata.TensorProperties, metadata.MetadataIndex,
               metadata.StorageMeta, metadata._MEM_FORMAT_ENCODING, filesystem._StorageInfo]
    # Megatron-core adds every rank's save plan to its index (``all_local_plans``, to check a cached plan): plain
    # records of DCP's planner (an enum built from its value), never read here
    classes += [planner.SavePlan, planner.WriteItem, planner.WriteItemType, planner.TensorWriteData,
                planner.BytesIOWriteData]
    allowed: dict[tuple[str, str], Any] = {(c.__module__, c.__name__): c for c in classes}
    allowed.update({("torch", "Size"): torch.Size, ("torch.serialization", "_get_layout"): _layout,
                    ("pathlib", "PosixPath"): pathlib.PosixPath, ("pathlib", "PurePosixPath"): pathlib.PurePosixPath})
    return allowed


class _IndexUnpickler(pickle.Unpickler):
    """Builds the allow-listed classes and torch dtypes, layouts and memory formats; refuses any other global."""

    allowed: dict[tuple[str, str], Any] = {}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.allowed:
            return self.allowed[module, name]
        value = getattr(torch, name, None) if module == "torch" else None
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            return value
        raise _RefusedError(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise _RefusedError(f"a persistent id {str(pid)[:40]}")


def read_dcp_metadata(iteration_dir: str) -> Any:
    """The ``torch.distributed.checkpoint.metadata.Metadata`` of ``<iteration_dir>/.metadata``, unpickled with
    the allow-list and checked (:func:`_check_index`); any problem is a one-line CheckpointError."""
    path = os.path.join(iteration_dir, DCP_METADATA)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing (an interrupted save?); {EARLIER}") from None
    except OSError as error:
        raise CheckpointError(f"checkpoint file {path} cannot be read: {error.strerror or error}") from None
    if not data:
        raise CheckpointError(f"checkpoint file {path} is empty (0 bytes); {EARLIER}")
    if not _IndexUnpickler.allowed:
        _IndexUnpickler.allowed = _allowed_globals()
    try:
        metadata = _IndexUnpickler(io.BytesIO(data)).load()
    except _RefusedError as refused:
        raise CheckpointError(f"checkpoint file {path} is refused: its pickle references {refused}, which is no "
                              "part of a DCP index; this code never writes that, so the file is not one of its "
                              "checkpoints (or was tampered with)") from None
    except Exception as error:  # noqa: BLE001 - whatever a cut or garbled pickle raises: one line
        first = str(error).strip().splitlines()[0][:120] if str(error).strip() else type(error).__name__
        raise CheckpointError(f"checkpoint file {path} is truncated or not a DCP index ({first}); {EARLIER}") from None
    _check_index(metadata, path)
    return metadata


def _is_size(value: Any, ndim: int | None = None) -> bool:
    return (isinstance(value, torch.Size) and all(isinstance(n, int) and n >= 0 for n in value)
            and (ndim is None or len(value) == ndim))


def plain_storage_name(name: Any) -> bool:
    """Whether ``name`` is a file name DCP's writer makes: a ``.distcp`` file directly in the iteration directory."""
    return (isinstance(name, str) and name.endswith(".distcp") and name == os.path.basename(name)
            and "\\" not in name and "\0" not in name and not name.startswith("."))


def _check_index(metadata: Any, path: str) -> None:
    """Raise a one-line CheckpointError unless ``metadata`` has the types DCP's reader relies on, every
    tensor chunk has a storage entry, and every storage entry points into a plain ``.distcp`` file."""
    from torch.distributed.checkpoint import filesystem
    from torch.distributed.checkpoint import metadata as md

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"checkpoint file {path} is not a DCP index this code reads: {what}; {EARLIER}")

    if not isinstance(metadata, md.Metadata):
        raise bad(f"it holds a {type(metadata).__name__}")
    entries, storage = metadata.state_dict_metadata, metadata.storage_data
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise bad("its key or storage table is not a dict")
    for index, info in storage.items():
        if not isinstance(index, md.MetadataIndex) or not isinstance(info, filesystem._StorageInfo):
            raise bad(f"a storage entry of type {type(info).__name__}")
        if not plain_storage_name(info.relative_path):
            raise CheckpointError(f"checkpoint file {path} names the storage file {str(info.relative_path)[:80]!r}, "
                                  f"which is not a plain .distcp file name inside {os.path.dirname(path)}: refused "
                                  "(this code never writes that; a tampered index?)")
        if not (isinstance(info.offset, int) and isinstance(info.length, int) and info.offset >= 0
                and info.length >= 0):
            raise bad(f"{index.fqn}'s byte range is not two non-negative integers")
        if info.transform_descriptors:
            raise bad(f"{index.fqn} is stored through transforms {info.transform_descriptors!r} (compression?), "
                      "which this code never writes")
    for key, entry in entries.items():
        if not isinstance(key, str):
            raise bad(f"a key of type {type(key).__name__}")
        if isinstance(entry, md.BytesStorageMetadata):
            chunks = [md.MetadataIndex(key)]
        elif isinstance(entry, md.TensorStorageMetadata):
            if not (_is_size(entry.size) and isinstance(entry.properties, md.TensorProperties)
                    and isinstance(entry.properties.dtype, torch.dtype) and isinstance(entry.chunks, list)):
                raise bad(f"{key} has no valid shape and dtype")
            for chunk in entry.chunks:
                if not (isinstance(chunk, md.ChunkStorageMetadata) and _is_size(chunk.offsets, len(entry.size))
                        and _is_size(chunk.sizes, len(entry.size))
                        and all(o + s <= n for o, s, n in zip(chunk.offsets, chunk.sizes, entry.size))):
                    raise bad(f"a piece of {key} lies outside its shape {list(entry.size)}")
            chunks = [md.MetadataIndex(key, chunk.offsets) for chunk in entry.chunks]
        else:
            raise bad(f"{key} is a {type(entry).__name__}")
        missing = [index for index in chunks if index not in storage]
        if missing:
            raise bad(f"{key}'s piece at {list(missing[0].offset or [])} has no storage entry")


def check_storage_files(iteration_dir: str, metadata: Any) -> None:
    """Every ``.distcp`` file the (vetted) index names exists and is long enough for every piece in it."""
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        path = os.path.join(iteration_dir, name)
        try:
            status = os.stat(path)
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint file {path} is missing (its {DCP_METADATA} names it); "
                                  f"{EARLIER}") from None
        except OSError as error:
            raise CheckpointError(f"checkpoint file {path} cannot be read: {error.strerror or error}") from None
        if not stat.S_ISREG(status.st_mode):
            raise CheckpointError(f"checkpoint file {path} is not a regular file; {EARLIER}")
        if status.st_size < end:
            raise CheckpointError(f"checkpoint file {path} is truncated: {status.st_size} bytes, its pieces end at "
                                  f"byte {end}; {EARLIER}")


# --------------------------------------------------------------------------------------------------
# Checksums: the CRC-32 of every record of a torch.save archive
# --------------------------------------------------------------------------------------------------


def has_checksums(records: list[zipfile.ZipInfo]) -> bool:
    """False for an archive saved with ``compute_crc32`` off (every CRC zero although some record holds bytes)."""
    return any(r.CRC for r in records) or all(r.file_size == 0 for r in records)


def corrupt(what: str, record: str) -> CheckpointError:
    """The one line for a record whose bytes differ from its saved checksum."""
    return CheckpointError(f"checkpoint file {what} is corrupt: its record {record} fails its CRC-32 checksum "
                           f"(the bytes changed after the save); {EARLIER}")


def verify_archive(source: str | IO[bytes], what: str) -> bool:
    """Read every record of the torch.save archive ``source`` (a path or a seekable file) and check its CRC-32.

    ``what`` names it in the message (a file, or a piece of a ``.distcp`` file). Returns False, checking
    nothing, for an archive saved without checksums. A mismatch or a broken archive is a CheckpointError."""
    try:
        with zipfile.ZipFile(source) as archive:
            records = archive.infolist()
            if not has_checksums(records):
                return False
            for record in records:
                try:
                    with archive.open(record) as data:
                        while data.read(_CHUNK):
                            pass
                except zipfile.BadZipFile as error:
                    if "CRC" in str(error):
                        raise corrupt(what, record.filename.split("/", 1)[-1]) from None
                    raise
    except (zipfile.BadZipFile, EOFError, ValueError, struct.error, NotImplementedError) as error:
        raise CheckpointError(f"checkpoint file {what} is truncated or corrupt ({error}); {EARLIER}") from None
    return True


class SavedArchive:
    """The record table of one torch.save archive, read from its zip directory (no record data read).

    Records are named without the archive's top folder (``data.pkl``, ``data/0``, ``byteorder``)."""

    def __init__(self, file: IO[bytes], what: str) -> None:
        self.file, self.what = file, what
        records = zipfile.ZipFile(file).infolist()
        self.records = {r.filename.split("/", 1)[-1]: r for r in records}
        self.checked = has_checksums(records)

    def data_offset(self, name: str) -> int:
        """Where record ``name``'s bytes start (after its local header; stored records only)."""
        record = self.records[name]
        if record.compress_type != zipfile.ZIP_STORED:
            raise zipfile.BadZipFile(f"record {name} is compressed")
        self.file.seek(record.header_offset)
        header = self.file.read(30)
        if len(header) != 30 or header[:4] != b"PK\x03\x04":
            raise zipfile.BadZipFile(f"bad local header of record {name}")
        name_length, extra_length = struct.unpack("<HH", header[26:30])
        return record.header_offset + 30 + name_length + extra_length

    def check(self, name: str, data: Any) -> None:
        """Raise the one-line CheckpointError when ``data`` (a buffer: the record's bytes as read) fails its CRC."""
        if self.checked and zlib.crc32(data) != self.records[name].CRC:
            raise corrupt(self.what, name)

    def read(self, name: str) -> bytes:
        """Record ``name``'s bytes, checked against its CRC-32."""
        self.file.seek(self.data_offset(name))
        data = self.file.read(self.records[name].file_size)
        if len(data) != self.records[name].file_size:
            raise zipfile.BadZipFile(f"record {name} is cut short")
        self.check(name, data)
        return data
