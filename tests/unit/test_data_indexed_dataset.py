"""The mmap indexed dataset: byte layout of docs/design.md §5, round trips, corruption errors."""

import struct

import numpy as np
import pytest

from megatron_like.data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexedDatasetError,
    best_fitting_dtype,
)

DOCS = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12, 13, 14, 15]]


def hand_made_idx(sizes, doc_idx, dtype_code):
    """The .idx bytes written out by hand from the format table (independent of the builder)."""
    pointers, offset = [], 0
    for s in sizes:
        pointers.append(offset)
        offset += 2 * s if dtype_code == 8 else 4 * s
    out = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + bytes([dtype_code])
    out += struct.pack("<Q", len(sizes)) + struct.pack("<Q", len(doc_idx))
    out += b"".join(struct.pack("<i", s) for s in sizes)
    out += b"".join(struct.pack("<q", p) for p in pointers)
    out += b"".join(struct.pack("<q", d) for d in doc_idx)
    return out


def write(prefix, docs, dtype=np.uint16):
    with IndexedDatasetBuilder(str(prefix), dtype) as builder:
        for doc in docs:
            builder.add_document(doc)
    return str(prefix)


def test_worked_example_is_102_and_30_bytes(tmp_path):
    prefix = write(tmp_path / "ex", DOCS)
    idx = (tmp_path / "ex.idx").read_bytes()
    data = (tmp_path / "ex.bin").read_bytes()
    assert len(idx) == 102 and len(data) == 30
    assert idx == hand_made_idx([5, 3, 7], [0, 1, 2, 3], 8)
    assert data == np.arange(1, 16, dtype="<u2").tobytes()
    ds = IndexedDataset(prefix)
    assert len(ds) == 3 and ds.num_documents == 3 and ds.num_tokens == 15
    assert ds.dtype == np.uint16
    assert [x.tolist() for x in ds[0:3]] == DOCS
    assert ds.get(2, offset=2, length=3).tolist() == [11, 12, 13]
    assert ds.get(2, offset=5).tolist() == [14, 15]
    assert ds[-1].tolist() == DOCS[-1]
    assert ds.document_sizes().tolist() == [5, 3, 7]


def test_reads_hand_made_files(tmp_path):
    # Multi-sequence documents (as --split-sentences writes): docs [[a, b], [c]].
    sizes, doc_idx = [2, 1, 3], [0, 2, 3]
    (tmp_path / "h.idx").write_bytes(hand_made_idx(sizes, doc_idx, 4))
    (tmp_path / "h.bin").write_bytes(np.array([7, 8, 9, 1, 2, 3], dtype="<i4").tobytes())
    ds = IndexedDataset(str(tmp_path / "h"))
    assert ds.dtype == np.int32
    assert ds.doc_idx.tolist() == doc_idx
    assert ds.get_document(0).tolist() == [7, 8, 9]
    assert ds.get_document(1).tolist() == [1, 2, 3]
    assert ds.document_sizes().tolist() == [3, 3]


def test_sentences_and_documents(tmp_path):
    with IndexedDatasetBuilder(str(tmp_path / "s"), np.int32) as b:
        b.add_document([1, 2, 3, 4], lengths=[1, 3])
        b.add_document([70000], lengths=[1])
    ds = IndexedDataset(str(tmp_path / "s"))
    assert ds.sizes.tolist() == [1, 3, 1] and ds.doc_idx.tolist() == [0, 2, 3]
    assert ds.get_document(1).tolist() == [70000]


def test_random_round_trip_and_merge(tmp_path):
    rng = np.random.default_rng(0)
    docs_a = [rng.integers(0, 50257, size=rng.integers(0, 40)).tolist() for _ in range(50)]
    docs_b = [rng.integers(0, 50257, size=rng.integers(1, 40)).tolist() for _ in range(30)]
    a, b = write(tmp_path / "a", docs_a), write(tmp_path / "b", docs_b)
    with IndexedDatasetBuilder(str(tmp_path / "m"), np.uint16) as merged:
        merged.add_index(a)
        merged.add_index(b)
    ds = IndexedDataset(str(tmp_path / "m"))
    assert [ds.get_document(i).tolist() for i in range(ds.num_documents)] == docs_a + docs_b
    with (
        IndexedDatasetBuilder(str(tmp_path / "w"), np.int32) as wrong,
        pytest.raises(ValueError, match="dtype"),
    ):
        wrong.add_index(a)


def test_empty_dataset(tmp_path):
    with IndexedDatasetBuilder(str(tmp_path / "e"), np.uint16):
        pass
    ds = IndexedDataset(str(tmp_path / "e"))
    assert len(ds) == 0 and ds.num_documents == 0


def test_abort_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError), IndexedDatasetBuilder(str(tmp_path / "x"), np.uint16) as b:
        b.add_item([1, 2])
        raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []


def test_pickle_reopens(tmp_path):
    import pickle

    ds = pickle.loads(pickle.dumps(IndexedDataset(write(tmp_path / "p", DOCS))))
    assert ds[1].tolist() == DOCS[1]


def test_best_fitting_dtype():
    assert best_fitting_dtype(50257) == np.uint16
    assert best_fitting_dtype(65500) == np.int32
    assert best_fitting_dtype(None) == np.int32


@pytest.mark.parametrize(
    "corrupt, file, message",
    [
        (lambda idx, data: (idx[:-1], data), "idx", "truncated"),
        (lambda idx, data: (idx + b"\x00", data), "idx", "trailing"),
        (lambda idx, data: (idx[:20], data), "idx", "header alone"),
        (lambda idx, data: (b"XXXXXXXXX" + idx[9:], data), "idx", "magic"),
        (lambda idx, data: (idx[:9] + struct.pack("<Q", 2) + idx[17:], data), "idx", "version 2"),
        (lambda idx, data: (idx[:17] + b"\x63" + idx[18:], data), "idx", "dtype code 99"),
        (lambda idx, data: (idx[:50] + struct.pack("<q", 4) + idx[58:], data), "idx", "pointers"),
        (lambda idx, data: (idx[:-8] + struct.pack("<q", 2), data), "idx", "document index"),
        (lambda idx, data: (idx, data[:-2]), "bin", "truncated"),
        (lambda idx, data: (idx, data + b"\x00\x00"), "bin", "trailing"),
    ],
)
def test_corruption_is_named(tmp_path, corrupt, file, message):
    prefix = write(tmp_path / "c", DOCS)
    idx, data = (tmp_path / "c.idx").read_bytes(), (tmp_path / "c.bin").read_bytes()
    idx, data = corrupt(idx, data)
    (tmp_path / "c.idx").write_bytes(idx)
    (tmp_path / "c.bin").write_bytes(data)
    with pytest.raises(IndexedDatasetError) as info:
        IndexedDataset(prefix)
    text = str(info.value)
    assert f"c.{file}" in text and message in text and "\n" not in text


def test_missing_files(tmp_path):
    write(tmp_path / "m", DOCS)
    (tmp_path / "m.bin").unlink()
    with pytest.raises(IndexedDatasetError, match=r"m\.bin: no such file"):
        IndexedDataset(str(tmp_path / "m"))
