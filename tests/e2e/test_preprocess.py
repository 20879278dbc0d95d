"""CLI runs of data_tools/preprocess.py and merge_datasets.py on tiny generated corpora."""

import gzip
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_like.data.indexed_dataset import IndexedDataset
from megatron_like.data.tokenizer import GPT2BPETokenizer
from tests.e2e.cli import run_data_tool as run_tool

TOOLS = Path(__file__).resolve().parents[2] / "data_tools"
GOOD = [
    "Hello world",
    "It's a test. With two sentences!",
    "unicode café 日本語 😀",
    "numbers 123 456",
    "last one\n\nwith newlines",
]


def write_jsonl(path, texts, key="text"):
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({key: t}) + "\n")
    return path


@pytest.fixture(scope="module")
def gpt2():
    return GPT2BPETokenizer()


def test_round_trip_token_for_token(tmp_path, gpt2):
    corpus = write_jsonl(tmp_path / "c.jsonl", GOOD)
    run_tool("preprocess.py", "--input", corpus, "--output-prefix", tmp_path / "out", "--append-eod")
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    assert ds.dtype == np.uint16 and ds.num_documents == len(GOOD)
    for i, text in enumerate(GOOD):
        assert ds.get_document(i).tolist() == gpt2.tokenize(text) + [50256]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl", "out_text_document.bin", "out_text_document.idx"]


def test_every_bad_kind_counted_and_good_docs_kept(tmp_path, gpt2):
    lines = [
        json.dumps({"text": GOOD[0]}).encode(),
        b"\xff\xfe not utf-8",  # line 2 undecodable
        json.dumps({"text": GOOD[1]}).encode(),
        b"   ",  # line 4 blank
        b'{"text": "unterminated',  # line 5 invalid json
        b"[1, 2, 3]",  # line 6 not an object
        b'{"body": "no text key"}',  # line 7 missing key
        b'{"text": 42}',  # line 8 not a string
        b'{"text": ""}',  # line 9 empty
        b'{"text": "\\ud800 lone surrogate"}',  # line 10 undecodable
        json.dumps({"text": GOOD[2]}).encode(),
    ]
    corpus = tmp_path / "bad.jsonl.gz"
    with gzip.open(corpus, "wb") as f:
        f.write(b"\n".join(lines) + b"\n")
    for workers in (1, 2):
        prefix = tmp_path / f"w{workers}"
        proc = run_tool(
            "preprocess.py", "--input", corpus, "--output-prefix", prefix, "--workers", workers, "--batch-lines", 2
        )
        ds = IndexedDataset(f"{prefix}_text_document")
        assert [ds.get_document(i).tolist() for i in range(3)] == [gpt2.tokenize(t) for t in GOOD[:3]]
        assert "skipped 8 bad lines" in proc.stderr
        for kind, where in [
            ("undecodable: 2", "bad.jsonl.gz:2, "),
            ("blank_line: 1", ":4"),
            ("invalid_json: 1", ":5"),
            ("not_an_object: 1", ":6"),
            ("missing_key: 1", ":7"),
            ("not_string: 1", ":8"),
            ("empty_text: 1", ":9"),
        ]:
            line = next(ln for ln in proc.stderr.splitlines() if kind in ln)
            assert where in line, line
    assert (tmp_path / "w1_text_document.bin").read_bytes() == (tmp_path / "w2_text_document.bin").read_bytes()


def test_lines_with_a_byte_order_mark_are_kept(tmp_path, gpt2):
    # A corpus concatenated from files saved on Windows: a BOM opens the file and again in the middle.
    bom = b"\xef\xbb\xbf"
    lines = [
        bom + json.dumps({"text": GOOD[0]}).encode(),
        json.dumps({"text": GOOD[1]}).encode(),
        bom + json.dumps({"text": GOOD[2]}, ensure_ascii=False).encode(),
        bom,  # line 4: a BOM alone is a blank line
        bom + b'{"text": "unterminated',  # line 5: still invalid json
    ]
    corpus = tmp_path / "bom.jsonl"
    corpus.write_bytes(b"\r\n".join(lines) + b"\r\n")
    proc = run_tool("preprocess.py", "--input", corpus, "--output-prefix", tmp_path / "bom")
    ds = IndexedDataset(str(tmp_path / "bom_text_document"))
    assert [ds.get_document(i).tolist() for i in range(ds.num_documents)] == [gpt2.tokenize(t) for t in GOOD[:3]]
    assert "skipped 2 bad lines" in proc.stderr, proc.stderr
    assert "blank_line: 1 (first at" in proc.stderr and "invalid_json: 1 (first at" in proc.stderr, proc.stderr


def test_workers_partitions_globs_and_keys_agree(tmp_path):
    rng = np.random.default_rng(0)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "data", "model", "token"]
    docs = [{"text": " ".join(rng.choice(words, size=rng.integers(1, 40))), "title": f"Title {i}."} for i in range(300)]
    (tmp_path / "in").mkdir()
    for part in range(3):
        with open(tmp_path / "in" / f"part{part}.jsonl", "w") as f:
            for d in docs[part * 100 : (part + 1) * 100]:
                f.write(json.dumps(d) + "\n")
    outputs = {}
    for name, extra in [
        ("serial", []),
        ("workers", ["--workers", 2, "--batch-lines", 7]),
        ("partitions", ["--partitions", 4, "--workers", 2]),
    ]:
        run_tool(
            "preprocess.py",
            "--input",
            tmp_path / "in",
            "--output-prefix",
            tmp_path / name,
            "--json-keys",
            "text",
            "title",
            "--append-eod",
            *extra,
        )
        outputs[name] = {
            k: (tmp_path / f"{name}_{k}_document.bin").read_bytes()
            + (tmp_path / f"{name}_{k}_document.idx").read_bytes()
            for k in ("text", "title")
        }
    assert outputs["serial"] == outputs["workers"] == outputs["partitions"]
    run_tool("preprocess.py", "--input", str(tmp_path / "in" / "part*.jsonl"), "--output-prefix", tmp_path / "glob")
    assert IndexedDataset(str(tmp_path / "glob_text_document")).num_documents == 300
    assert not list(tmp_path.glob("*.tmp-*")) and not list(tmp_path.glob("*.part*"))


def test_split_sentences(tmp_path, gpt2):
    corpus = write_jsonl(tmp_path / "s.jsonl", ["First sentence. Second one! Third? yes", "Single"])
    run_tool("preprocess.py", "--input", corpus, "--output-prefix", tmp_path / "s", "--split-sentences", "--append-eod")
    ds = IndexedDataset(str(tmp_path / "s_text_sentence"))
    assert ds.doc_idx.tolist() == [0, 3, 4]
    assert [gpt2.detokenize(ds[i].tolist()) for i in range(3)] == [
        "First sentence.",
        " Second one!",
        " Third? yes<|endoftext|>",
    ]


def test_fatal_errors_write_nothing(tmp_path):
    proc = run_tool(
        "preprocess.py", "--input", tmp_path / "missing.jsonl", "--output-prefix", tmp_path / "x", check=False
    )
    assert proc.returncode == 1 and "missing.jsonl" in proc.stderr
    corpus = tmp_path / "allbad.jsonl"
    corpus.write_text("nope\n{}\n")
    proc = run_tool("preprocess.py", "--input", corpus, "--output-prefix", tmp_path / "x", check=False)
    assert proc.returncode == 1 and "no good document" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["allbad.jsonl"]
    proc = run_tool(
        "preprocess.py", "--input", corpus, "--output-prefix", tmp_path / "x", "--workers", "0", check=False
    )
    assert proc.returncode == 2


def test_other_tokenizers(tmp_path, gpt2):
    corpus = write_jsonl(tmp_path / "n.jsonl", ["1 2 3", "70000 5"])
    run_tool(
        "preprocess.py",
        "--input",
        corpus,
        "--output-prefix",
        tmp_path / "n",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        80000,
        "--append-eod",
    )
    ds = IndexedDataset(str(tmp_path / "n_text_document"))
    assert ds.dtype == np.int32 and ds.get_document(1).tolist() == [70000, 5, 80000]
    gpt2._engine.save(str(tmp_path / "tokenizer.json"))
    corpus = write_jsonl(tmp_path / "h.jsonl", GOOD)
    run_tool(
        "preprocess.py",
        "--input",
        corpus,
        "--output-prefix",
        tmp_path / "h",
        "--tokenizer-type",
        "HuggingFaceTokenizer",
        "--tokenizer-model",
        tmp_path / "tokenizer.json",
    )
    run_tool(
        "preprocess.py",
        "--input",
        corpus,
        "--output-prefix",
        tmp_path / "p",
        "--tokenizer-type",
        "PurePythonGPT2BPETokenizer",
    )
    assert (tmp_path / "h_text_document.bin").read_bytes() == (tmp_path / "p_text_document.bin").read_bytes()


def test_merge_datasets(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", GOOD[:2])
    write_jsonl(tmp_path / "b.jsonl", GOOD[2:])
    (tmp_path / "parts").mkdir()
    for name in ("a", "b"):
        run_tool("preprocess.py", "--input", tmp_path / f"{name}.jsonl", "--output-prefix", tmp_path / "parts" / name)
    run_tool("merge_datasets.py", "--input", tmp_path / "parts", "--output-prefix", tmp_path / "merged")
    write_jsonl(tmp_path / "all.jsonl", GOOD)
    run_tool("preprocess.py", "--input", tmp_path / "all.jsonl", "--output-prefix", tmp_path / "all")
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"merged{ext}").read_bytes() == (tmp_path / f"all_text_document{ext}").read_bytes()
    (tmp_path / "parts" / "b_text_document.bin").write_bytes(b"\x00")
    proc = run_tool("merge_datasets.py", "--input", tmp_path / "parts", "--output-prefix", tmp_path / "m2", check=False)
    assert proc.returncode == 1 and "b_text_document.bin" in proc.stderr and not (tmp_path / "m2.idx").exists()


def test_line_blocks_read_the_lines_iter_lines_reads(tmp_path):
    # The main process reads raw line blocks and the workers split them: together they must give exactly
    # _common.iter_lines' lines (CRLF ends stripped, blank lines and an unterminated last line kept) and
    # numbers, for shards that end mid-line (a line starting before `end` is read whole).
    sys.path.insert(0, str(TOOLS))
    try:
        import _common
        import preprocess
    finally:
        sys.path.pop(0)
    data = b'{"a": 1}\r\n\n\r\nxy\r\r\nlong line with words\n{"b": 2}\nno end'
    path = tmp_path / "lines.jsonl"
    path.write_bytes(data)
    starts = [0] + [i + 1 for i, byte in enumerate(data) if byte == ord("\n")]
    for line_index, start in enumerate(starts):
        for end in [None, *range(start, len(data) + 2)]:
            expected = list(_common.iter_lines(str(path), start, end, line_index + 1))
            for batch_lines in (1, 2, 3, 100):
                got = []
                for first, blob in preprocess._line_blocks(str(path), start, end, line_index + 1, batch_lines):
                    lines = preprocess._split_lines(blob)
                    assert 1 <= len(lines) <= batch_lines
                    got += [(first + i, line) for i, line in enumerate(lines)]
                assert got == expected, (start, end, batch_lines)
