"""Reading a ``torch_dist`` checkpoint's pieces: every piece verified against its CRC-32, whole saved tensors read
straight into their destination.

DCP stores each tensor item as a torch.save zip inside the rank's .distcp file. Its reader torch.loads
the item into a freshly allocated tensor (first touch of every page), then copies it into the destination:
twice the memory traffic of the bytes on disk. When the item is the whole saved tensor and the
destination is contiguous with the same dtype and size, the storage record's bytes are exactly the
destination's, and one readinto() does it.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import io
import os
import pickle
import struct
import zipfile
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from megatron_like.training.checkpoint_integrity import EARLIER, SavedArchive, verify_archive
from megatron_like.training.checkpointing import CheckpointError

_STORAGE_DTYPES = {
    "FloatStorage": torch.float32, "BFloat16Storage": torch.bfloat16, "HalfStorage": torch.float16,
    "DoubleStorage": torch.float64, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
}


@dataclasses.dataclass
class _SavedTensor:
    """What an item's ``data.pkl`` says about its one tensor (read without touching the storage bytes)."""

    dtype: torch.dtype
    record: str  # the storage's record name in the zip, e.g. ``data/0``
    storage_numel: int
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class _TensorPickle(pickle.Unpickler):
    """Unpickles a ``torch.save``'d plain tensor into a :class:`_SavedTensor`; anything else is refused
    (UnpicklingError), and the item goes through DCP's own reader."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *_: _SavedTensor(
                storage[0], f"data/{storage[1]}", storage[2], offset, tuple(size), tuple(stride))
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> tuple[torch.dtype, str, int]:
        kind, dtype, key, _location, numel = pid  # ("storage", element type, key, "cpu", numel)
        if kind != "storage" or not isinstance(dtype, torch.dtype):
            raise pickle.UnpicklingError(str(pid))
        return dtype, key, numel


class _Window(io.RawIOBase):
    """Bytes ``[start, start + length)`` of an open file, as a seekable file of their own (one DCP item)."""

    def __init__(self, file: io.RawIOBase, start: int, length: int) -> None:
        super().__init__()
        self.file, self.start, self.length, self.pos = file, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        self.pos = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence] + pos
        return self.pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")[:max(0, self.length - self.pos)]
        self.file.seek(self.start + self.pos)
        got = self.file.readinto(view) or 0
        self.pos += got
        return got


class DirectReader(FileSystemReader):
    """DCP's file reader that verifies every piece's checksum and reads a whole saved tensor straight into
    its destination tensor.

    DCP gets the index vetted by :func:`read_dcp_metadata` (``read_metadata`` returns it; the file is never
    unpickled by DCP). Every item read is checked against the CRC-32s its archive was saved with
    (docs/checkpoints.md): a changed byte is a one-line CheckpointError, never a loaded value.

    The direct read is taken per item when: the item is the whole saved tensor (not a sub-range of a chunk
    that this layout splits; at the saved layout every item is whole), the destination is a contiguous CPU
    tensor of the saved dtype and shape, and the saved tensor is a plain contiguous one without a storage
    offset. Its CRC is computed over the destination's bytes once read. Every other item (bytes, sub-ranges,
    strided destinations) is checked whole, then read by the parent's ``read_data``. ``direct`` and
    ``fallback`` count the tensor items each way (tests check which path a load took; bytes always take the
    parent's).
    """

    def __init__(self, path: str, metadata: Any) -> None:
        super().__init__(path)
        self.metadata = metadata
        self.direct = self.fallback = 0

    def read_metadata(self) -> Any:  # no **kwargs: DCP then never asks for a rank-local index instead
        return self.metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        rest = []
        for relative_path, items in per_file.items():
            with open(os.path.join(self.path, relative_path), "rb", buffering=0) as file:
                # In file order: one forward pass over the file.
                for item in sorted(items, key=lambda i: self.storage_data[i.storage_index].offset):
                    if item.type == LoadItemType.BYTE_IO or not self._read_into(file, item, planner):
                        info = self.storage_data[item.storage_index]
                        verify_archive(_Window(file, info.offset, info.length), self._piece_name(item))
                        rest.append(item)
        self.direct += len(plan.items) - len(rest)
        self.fallback += sum(item.type != LoadItemType.BYTE_IO for item in rest)
        if rest:
            return super().read_data(dataclasses.replace(plan, items=rest), planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _piece_name(self, item: ReadItem) -> str:
        """``<dir>/__0_0.distcp (piece model.x at [0, 0])``: where a message points."""
        info, index = self.storage_data[item.storage_index], item.storage_index
        at = f" at {list(index.offset)}" if index.offset is not None else ""
        return f"{os.path.join(self.path, info.relative_path)} (piece {index.fqn}{at})"

    def _read_into(self, file: io.RawIOBase, item: ReadItem, planner: LoadPlanner) -> bool:
        """Read ``item`` into its destination, verify and commit it; False (nothing read) when it does not qualify."""
        info = self.storage_data[item.storage_index]
        if any(item.storage_offsets):
            return False
        target = planner.resolve_tensor(item).detach()
        if target.device.type != "cpu" or not target.is_contiguous() or target.numel() == 0:
            return False
        try:
            archive = SavedArchive(_Window(file, info.offset, info.length), self._piece_name(item))
            saved = _TensorPickle(io.BytesIO(archive.read("data.pkl"))).load()
            byteorder = archive.read("byteorder") if "byteorder" in archive.records else b"little"
            if not isinstance(saved, _SavedTensor) or saved.record not in archive.records:
                return False
            start = info.offset + archive.data_offset(saved.record)
        except (pickle.UnpicklingError, zipfile.BadZipFile, KeyError, ValueError, TypeError, struct.error):
            return False  # not a plain tensor archive: the whole-piece check and DCP's reader say what it is
        lengths = tuple(item.lengths)
        if not (saved.dtype == target.dtype and saved.storage_offset == 0
                and saved.size == lengths == tuple(target.shape) and saved.storage_numel == target.numel()
                and (saved.stride == torch.empty(saved.size, device="meta").stride() or target.numel() == 1)
                and byteorder == b"little" and archive.records[saved.record].file_size == target.nbytes):
            return False
        file.seek(start)
        # A view of the destination's bytes through ctypes: `.numpy()` would mark its storage non-resizable,
        # and ZeRO-3 frees gathered parameters by resizing their storage to 0.
        view = memoryview((ctypes.c_char * target.nbytes).from_address(target.data_ptr())).cast("B")
        archive.check(saved.record, _read_exactly(file, view, self._piece_name(item)))
        planner.commit_tensor(item, target)
        return True


def _read_exactly(file: io.RawIOBase, view: memoryview, what: str) -> memoryview:
    """Fill ``view`` from ``file``; returns it (whole). A file that ends first is a one-line CheckpointError."""
    rest = view
    while len(rest):
        got = file.readinto(rest)
        if not got:
            raise CheckpointError(f"checkpoint file {what} ends inside the piece (a truncated checkpoint?); "
                                       f"{EARLIER}")
        rest = rest[got:]
    return view
