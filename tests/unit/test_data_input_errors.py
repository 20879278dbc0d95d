"""A ``--data-path`` whose index is garbage, or whose token ids the vocabulary cannot hold, stops ``pretrain_gpt.main``
before any process group with one line (once: rank 0); the token id range is scanned once and then read from
the index cache."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist

import pretrain_gpt
from megatron_like.config import ConfigError, DataConfig
from megatron_like.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron_like.training.preflight import check_gpt_data

FLAGS = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
         "--micro-batch-size", "1", "--train-iters", "2", "--eval-iters", "0", "--make-vocab-size-divisible-by", "8",
         "--num-workers", "0", "--tokenizer-type", "NullTokenizer"]
LARGEST_ID = 199


def write_dataset(prefix: str, largest: int = LARGEST_ID, docs: int = 40) -> str:
    """``docs`` documents of 30 uint16 ids in [0, ``largest``], ``largest`` itself in the last one."""
    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(prefix, np.uint16) as builder:
        for doc in range(docs):
            builder.add_document(np.append(rng.integers(0, largest, size=29), largest if doc == docs - 1 else 0))
    return prefix


def one_error_line(argv: list[str], capsys, monkeypatch) -> str:
    """The single line ``pretrain_gpt.main(argv)`` prints before exiting with status 2 (and nothing on rank 1)."""
    for rank in ("1", "0"):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as stopped:
            pretrain_gpt.main(argv)
        assert stopped.value.code == 2 and not dist.is_initialized()
        err = capsys.readouterr().err
        if rank == "1":
            assert err == "", err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def test_garbage_index_is_one_line_before_any_process_group(tmp_path, capsys, monkeypatch):
    good = write_dataset(str(tmp_path / "good"))
    idx, data = Path(good + ".idx").read_bytes(), Path(good + ".bin").read_bytes()
    garbage = {
        "random bytes": (bytes(np.random.default_rng(1).integers(0, 256, 300, dtype=np.uint8)), "not a Megatron"),
        "empty": (b"", "truncated index: 0 bytes"),
        "truncated": (idx[:-8], "truncated"),
        "sizes overwritten": (idx[:40] + b"\xff" * 8 + idx[48:], "corrupt sizes"),
    }
    for name, (content, problem) in garbage.items():
        prefix = tmp_path / name.replace(" ", "_")
        prefix.with_suffix(".bin").write_bytes(data)
        prefix.with_suffix(".idx").write_bytes(content)
        line = one_error_line(FLAGS + ["--vocab-size", "300", "--data-path", str(prefix)], capsys, monkeypatch)
        assert f"--data-path prefix {prefix}: {prefix}.idx" in line and problem in line, (name, line)
        assert "binarize the corpus again with data_tools/preprocess.py" in line, line


def test_token_ids_outside_the_vocabulary_are_one_line_before_any_process_group(tmp_path, capsys, monkeypatch):
    prefix = write_dataset(str(tmp_path / "ids"))
    line = one_error_line(FLAGS + ["--vocab-size", "100", "--data-path", prefix], capsys, monkeypatch)
    assert f"{prefix}.bin holds token id {LARGEST_ID}, outside the vocabulary" in line, line
    assert f"pass --vocab-size {LARGEST_ID} or more" in line, line
    # One id over, in one dataset of a blend: the largest id must be exactly the largest the data holds.
    other = write_dataset(str(tmp_path / "other"), largest=50)
    line = one_error_line(FLAGS + ["--vocab-size", str(LARGEST_ID - 1), "--data-path", "0.5", other, "0.5", prefix],
                          capsys, monkeypatch)
    assert f"{prefix}.bin holds token id {LARGEST_ID}" in line, line
    negative = str(tmp_path / "negative")
    with IndexedDatasetBuilder(negative, np.int32) as builder:
        builder.add_document([5, -7, 3])
    line = one_error_line(FLAGS + ["--vocab-size", "300", "--data-path", negative], capsys, monkeypatch)
    assert "holds token id -7, and token ids are never negative" in line, line


def test_the_token_id_range_is_scanned_once_and_read_from_the_cache(tmp_path, monkeypatch):
    prefix = write_dataset(str(tmp_path / "data"))
    data = DataConfig(data_path=[prefix], tokenizer_type="NullTokenizer", data_cache_path=str(tmp_path / "cache"))
    check_gpt_data(data, LARGEST_ID + 1)  # every id fits: no error, and the range is now cached
    assert len(list((tmp_path / "cache").glob("*_token_id_range.json"))) == 1

    def no_scan(self):
        raise AssertionError("scanned again")

    monkeypatch.setattr(IndexedDataset, "token_id_range", no_scan)
    with pytest.raises(ConfigError, match=f"holds token id {LARGEST_ID}"):
        check_gpt_data(data, LARGEST_ID)
    write_dataset(prefix, largest=LARGEST_ID + 1, docs=41)  # rewritten with larger ids: the cached range is stale
    monkeypatch.undo()
    with pytest.raises(ConfigError, match=f"holds token id {LARGEST_ID + 1}"):
        check_gpt_data(data, LARGEST_ID + 1)


def test_token_id_range_reads_every_chunk(tmp_path):
    tokens = np.arange(10, 110, dtype=np.int32)
    tokens[57], tokens[3] = 1000, -4
    with IndexedDatasetBuilder(str(tmp_path / "t"), np.int32) as builder:
        builder.add_document(tokens[:50])
        builder.add_document(tokens[50:])
    for chunk_tokens in (1, 7, 100, 1000):
        assert IndexedDataset(str(tmp_path / "t")).token_id_range(chunk_tokens) == (-4, 1000)
    IndexedDatasetBuilder(str(tmp_path / "empty"), np.int32).finalize()
    assert IndexedDataset(str(tmp_path / "empty")).token_id_range() == (0, -1)
