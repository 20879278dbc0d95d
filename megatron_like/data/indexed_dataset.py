"""Megatron's mmap indexed dataset (``<prefix>.bin`` + ``<prefix>.idx``): reader and builder.

Byte layout (little-endian, docs/design.md §5):

    .idx: magic b"MMIDIDX\\x00\\x00" | version u64 = 1 | dtype code u8 | N u64 | D+1 u64
          | sizes int32[N] | byte pointers int64[N] | document indices int64[D+1]
    .bin: the token arrays of the N sequences, concatenated, no header

A document is one or more consecutive sequences (several with ``--split-sentences``); the document
index array starts with 0 and holds, for each document, the sequence index where it ends.
No torch import: the data tools use this module.
"""

from __future__ import annotations

import os
import struct
from array import array
from collections.abc import Iterable

import numpy as np

HEADER_MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = 34  # 9 magic + 8 version + 1 dtype + 8 N + 8 (D+1)

DTYPE_CODES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
CODE_OF_DTYPE = {np.dtype(t): c for c, t in DTYPE_CODES.items()}


class IndexedDatasetError(ValueError):
    """A ``.idx`` or ``.bin`` file is missing, truncated or corrupt (the message names the file)."""


def best_fitting_dtype(vocab_size: int | None) -> type:
    """Return Megatron's token dtype: uint16 when the vocabulary is smaller than 65500, else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def index_file_path(prefix: str) -> str:
    """Return ``<prefix>.idx``."""
    return prefix + ".idx"


def data_file_path(prefix: str) -> str:
    """Return ``<prefix>.bin``."""
    return prefix + ".bin"


def dataset_exists(prefix: str) -> bool:
    """Return whether both files of the dataset exist."""
    return os.path.isfile(index_file_path(prefix)) and os.path.isfile(data_file_path(prefix))


def _mmap_bytes(path: str) -> np.ndarray:
    """Return the file as a read-only uint8 array backed by mmap (an empty array for an empty file)."""
    if os.path.getsize(path) == 0:
        return np.zeros(0, dtype=np.uint8)
    return np.memmap(path, dtype=np.uint8, mode="r")


class IndexedDataset:
    """Read-only view of a Megatron mmap dataset; ``ds[i]`` is sequence i as a numpy array.

    Opening reads and checks the index (O(N) vectorized checks); every access after that is O(1)
    and copies nothing: arrays are views into the mmap of ``.bin``.
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._open(prefix)

    def _open(self, prefix: str) -> None:
        idx_path, bin_path = index_file_path(prefix), data_file_path(prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise IndexedDatasetError(f"{path}: no such file (dataset prefix {prefix!r})")
        idx = _mmap_bytes(idx_path)
        if idx.size < HEADER_BYTES:
            raise IndexedDatasetError(
                f"{idx_path}: truncated index: {idx.size} bytes, the header alone needs {HEADER_BYTES}"
            )
        header = bytes(idx[:HEADER_BYTES])
        if header[:9] != HEADER_MAGIC:
            raise IndexedDatasetError(f"{idx_path}: not a Megatron mmap index (magic {header[:9]!r})")
        (version,) = struct.unpack("<Q", header[9:17])
        if version != VERSION:
            raise IndexedDatasetError(f"{idx_path}: unsupported index version {version} (expected 1)")
        code = header[17]
        if code not in DTYPE_CODES:
            raise IndexedDatasetError(f"{idx_path}: unknown dtype code {code}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        n_seq, n_doc_idx = struct.unpack("<QQ", header[18:34])
        expected = HEADER_BYTES + 12 * n_seq + 8 * n_doc_idx
        if idx.size != expected:
            problem = "truncated" if idx.size < expected else "has trailing bytes"
            raise IndexedDatasetError(
                f"{idx_path}: {problem}: {idx.size} bytes, expected {expected} for {n_seq} sequences "
                f"and {n_doc_idx} document indices"
            )
        self._idx_buffer = idx
        self.sizes = np.frombuffer(idx, dtype=np.int32, count=n_seq, offset=HEADER_BYTES)
        """int32 [N]: tokens of each sequence."""
        self.pointers = np.frombuffer(idx, dtype=np.int64, count=n_seq, offset=HEADER_BYTES + 4 * n_seq)
        """int64 [N]: byte offset of each sequence in .bin."""
        self.doc_idx = np.frombuffer(idx, dtype=np.int64, count=n_doc_idx, offset=HEADER_BYTES + 12 * n_seq)
        """int64 [D+1]: 0, then the sequence index where each document ends."""
        self._check_index(idx_path)

        data = _mmap_bytes(bin_path)
        needed = int(self.pointers[-1]) + int(self.sizes[-1]) * self.dtype.itemsize if n_seq else 0
        if data.size != needed:
            problem = "truncated" if data.size < needed else "has trailing bytes"
            raise IndexedDatasetError(
                f"{bin_path}: {problem}: {data.size} bytes, the index {idx_path} describes {needed}"
            )
        self._bin_buffer = data

    def _check_index(self, idx_path: str) -> None:
        n_seq = len(self.sizes)
        if len(self.doc_idx) == 0 or self.doc_idx[0] != 0 or self.doc_idx[-1] != n_seq:
            raise IndexedDatasetError(
                f"{idx_path}: corrupt document index: must start at 0 and end at {n_seq} sequences"
            )
        if np.any(np.diff(self.doc_idx) < 0):
            raise IndexedDatasetError(f"{idx_path}: corrupt document index: not non-decreasing")
        if n_seq == 0:
            return
        if np.any(self.sizes < 0):
            raise IndexedDatasetError(f"{idx_path}: corrupt sizes: negative sequence length")
        expected = np.zeros(n_seq, dtype=np.int64)
        np.cumsum(self.sizes[:-1].astype(np.int64) * self.dtype.itemsize, out=expected[1:])
        if not np.array_equal(expected, self.pointers):
            bad = int(np.flatnonzero(expected != self.pointers)[0])
            raise IndexedDatasetError(
                f"{idx_path}: corrupt pointers: sequence {bad} starts at byte {int(self.pointers[bad])}, "
                f"its predecessors end at {int(expected[bad])}"
            )

    def __getstate__(self) -> dict:
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict) -> None:
        self.prefix = state["prefix"]
        self._open(self.prefix)

    def __len__(self) -> int:
        """Return the number of sequences N."""
        return len(self.sizes)

    @property
    def num_documents(self) -> int:
        """Return the number of documents D."""
        return len(self.doc_idx) - 1

    @property
    def num_tokens(self) -> int:
        """Return the total number of tokens in .bin."""
        return int(self.sizes.sum(dtype=np.int64))

    def __getitem__(self, idx: int | slice) -> np.ndarray | list[np.ndarray]:
        """Return sequence ``idx`` (shape [sizes[idx]]) or, for a slice, a list of sequences."""
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError("IndexedDataset slices must be contiguous (step 1)")
            return [self.get(i) for i in range(start, stop)]
        if idx < 0:
            idx += len(self)
        if not 0 <= idx < len(self):
            raise IndexError(f"sequence {idx} out of range for {len(self)} sequences in {self.prefix}")
        return self.get(idx)

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Return tokens ``[offset, offset + length)`` of sequence ``idx`` (shape [length]), a view."""
        size = int(self.sizes[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) outside sequence {idx} of {size} tokens")
        start = int(self.pointers[idx]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin_buffer, dtype=self.dtype, count=length, offset=start)

    def get_document(self, doc: int) -> np.ndarray:
        """Return every token of document ``doc`` (its sequences concatenated), shape [tokens]."""
        first, last = int(self.doc_idx[doc]), int(self.doc_idx[doc + 1])
        if last == first:
            return np.zeros(0, dtype=self.dtype)
        start = int(self.pointers[first])
        count = int(self.sizes[first:last].sum(dtype=np.int64))
        return np.frombuffer(self._bin_buffer, dtype=self.dtype, count=count, offset=start)

    def token_id_range(self, chunk_tokens: int = 1 << 22) -> tuple[int, int]:
        """Return (smallest, largest) token id in ``.bin``, or (0, -1) when it holds no token.

        Reads the whole file, ``chunk_tokens`` at a time (a few MB: bounded memory on any size).
        """
        tokens = np.frombuffer(self._bin_buffer, dtype=self.dtype) if self._bin_buffer.size else np.zeros(0)
        smallest, largest = 0, -1
        for start in range(0, tokens.size, chunk_tokens):
            chunk = tokens[start : start + chunk_tokens]
            low, high = int(chunk.min()), int(chunk.max())
            smallest, largest = (low, high) if start == 0 else (min(smallest, low), max(largest, high))
        return smallest, largest

    def document_sizes(self) -> np.ndarray:
        """Return int64 [D]: tokens of each document."""
        cum = np.concatenate([[0], np.cumsum(self.sizes, dtype=np.int64)])
        return cum[self.doc_idx[1:]] - cum[self.doc_idx[:-1]]


class IndexedDatasetBuilder:
    """Write a Megatron mmap dataset under temporary names; ``finalize`` renames it into place.

    Until ``finalize`` returns, ``<prefix>.bin``/``.idx`` are untouched, so an interrupted run never
    leaves a valid-looking half dataset. The index lists grow in compact ``array`` storage.
    """

    def __init__(self, prefix: str, dtype: type | np.dtype = np.int32) -> None:
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise ValueError(f"dtype {self.dtype} has no Megatron dtype code")
        self._tmp_suffix = f".tmp-{os.getpid()}"
        self._bin_tmp = data_file_path(prefix) + self._tmp_suffix
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        self._bin = open(self._bin_tmp, "wb")  # noqa: SIM115 - closed in finalize/abort
        self._sizes = array("i")
        self._doc_idx = array("q", [0])
        self._finished = False

    @property
    def num_sequences(self) -> int:
        """Return the sequences written so far."""
        return len(self._sizes)

    def add_item(self, tokens: Iterable[int] | np.ndarray) -> None:
        """Append one sequence (array-like of token ids)."""
        arr = np.asarray(tokens, dtype=self.dtype)
        if arr.ndim != 1:
            raise ValueError(f"a sequence must be 1-D, got shape {arr.shape}")
        if arr.size > np.iinfo(np.int32).max:
            raise ValueError(f"sequence of {arr.size} tokens does not fit the int32 sizes array")
        self._bin.write(arr.tobytes(order="C"))
        self._sizes.append(int(arr.size))

    def end_document(self) -> None:
        """Close the current document: the sequences added since the last call form one document."""
        self._doc_idx.append(len(self._sizes))

    def add_document(self, tokens: Iterable[int] | np.ndarray, lengths: Iterable[int] | None = None) -> None:
        """Append one document: ``tokens`` split into sequences of ``lengths`` (one sequence if None)."""
        arr = np.asarray(tokens, dtype=self.dtype)
        if lengths is None:
            self.add_item(arr)
        else:
            lengths = list(lengths)
            if sum(lengths) != arr.size:
                raise ValueError(f"sequence lengths sum to {sum(lengths)}, the document has {arr.size} tokens")
            start = 0
            for n in lengths:
                self.add_item(arr[start : start + n])
                start += n
        self.end_document()

    def add_documents(
        self, tokens: np.ndarray, sequence_lengths: Iterable[int], sequences_per_document: Iterable[int]
    ) -> None:
        """Append many documents in one write (the fast path of ``preprocess.py``).

        ``tokens`` [sum(sequence_lengths)] holds the sequences back to back; document k is the next
        ``sequences_per_document[k]`` sequences.
        """
        arr = np.asarray(tokens, dtype=self.dtype)
        lengths = np.asarray(sequence_lengths, dtype=np.int64)
        counts = np.asarray(sequences_per_document, dtype=np.int64)
        if int(lengths.sum()) != arr.size or int(counts.sum()) != lengths.size:
            raise ValueError(
                f"{arr.size} tokens, {lengths.size} sequence lengths summing to {int(lengths.sum())} and "
                f"{int(counts.sum())} sequences in documents do not agree"
            )
        if lengths.size and lengths.max() > np.iinfo(np.int32).max:
            raise ValueError("a sequence does not fit the int32 sizes array")
        self._bin.write(arr.tobytes(order="C"))
        ends = len(self._sizes) + np.cumsum(counts)
        self._sizes.frombytes(lengths.astype(np.int32).tobytes())
        self._doc_idx.frombytes(ends.astype(np.int64).tobytes())

    def add_index(self, prefix: str) -> None:
        """Append every sequence and document of the dataset at ``prefix`` (same dtype required)."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise ValueError(f"{prefix}: dtype {other.dtype} differs from the output dtype {self.dtype}")
        offset = len(self._sizes)
        self._sizes.extend(other.sizes.tolist())
        self._doc_idx.extend((other.doc_idx[1:] + offset).tolist())
        chunk = 1 << 26
        buffer = other._bin_buffer
        for start in range(0, buffer.size, chunk):
            self._bin.write(buffer[start : start + chunk].tobytes())

    def finalize(self) -> None:
        """Write the index, fsync both files and rename them to ``<prefix>.bin``/``.idx``."""
        if self._doc_idx[-1] != len(self._sizes):
            self.end_document()  # sequences added without end_document form a last document
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        sizes = np.frombuffer(self._sizes, dtype=np.int32) if self._sizes else np.zeros(0, np.int32)
        pointers = np.zeros(len(sizes), dtype=np.int64)
        if len(sizes) > 1:
            np.cumsum(sizes[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        doc_idx = np.frombuffer(self._doc_idx, dtype=np.int64)
        idx_tmp = index_file_path(self.prefix) + self._tmp_suffix
        with open(idx_tmp, "wb") as f:
            f.write(HEADER_MAGIC)
            f.write(struct.pack("<Q", VERSION))
            f.write(struct.pack("<B", CODE_OF_DTYPE[self.dtype]))
            f.write(struct.pack("<Q", len(sizes)))
            f.write(struct.pack("<Q", len(doc_idx)))
            f.write(sizes.astype("<i4").tobytes(order="C"))
            f.write(pointers.astype("<i8").tobytes(order="C"))
            f.write(doc_idx.astype("<i8").tobytes(order="C"))
            f.flush()
            os.fsync(f.fileno())
        # .bin first: a reader that finds the new .idx always finds the matching .bin.
        os.replace(self._bin_tmp, data_file_path(self.prefix))
        os.replace(idx_tmp, index_file_path(self.prefix))
        self._finished = True

    def abort(self) -> None:
        """Close and delete the temporary files; the destination is left as it was."""
        if not self._bin.closed:
            self._bin.close()
        for path in (self._bin_tmp, index_file_path(self.prefix) + self._tmp_suffix):
            if os.path.exists(path):
                os.remove(path)
        self._finished = True

    def __enter__(self) -> IndexedDatasetBuilder:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._finished:
            self.finalize()


# Megatron-LM's names, so code ported from it reads the same.
MMapIndexedDataset = IndexedDataset
MMapIndexedDatasetBuilder = IndexedDatasetBuilder
