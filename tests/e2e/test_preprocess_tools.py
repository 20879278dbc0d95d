"""CLI runs of the corpus tools: demo corpus, tokenizer training, cleanup, dedup, URL blacklist, shuffle."""

import json
from pathlib import Path

import numpy as np

from megatron_like.data.indexed_dataset import IndexedDataset
from megatron_like.data.tokenizer import GPT2BPETokenizer
from tests.e2e.cli import run_data_tool as run_tool
from tests.e2e.cli import run_script


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def test_demo_pipeline_corpus_tokenizer_preprocess(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    run_tool("make_demo_corpus.py", "--output", corpus, "--max-mb", "0.3")
    again = tmp_path / "again.jsonl"
    run_tool("make_demo_corpus.py", "--output", again, "--max-mb", "0.3")
    assert corpus.read_bytes() == again.read_bytes() and 0.2e6 < corpus.stat().st_size <= 0.3e6
    docs = read_jsonl(corpus)
    assert all(len(d["text"]) >= 200 and ".py" in d["source"] for d in docs)
    run_tool("train_tokenizer.py", "--input", corpus, "--output-dir", tmp_path / "tok", "--vocab-size", 600)
    vocab = json.loads((tmp_path / "tok" / "vocab.json").read_text())
    assert len(vocab) == 600 and vocab["<|endoftext|>"] == 0
    assert (tmp_path / "tok" / "merges.txt").read_text().startswith("#version")
    files = (str(tmp_path / "tok" / "vocab.json"), str(tmp_path / "tok" / "merges.txt"))
    run_tool(
        "preprocess.py",
        "--input",
        corpus,
        "--output-prefix",
        tmp_path / "demo",
        "--vocab-file",
        files[0],
        "--merge-file",
        files[1],
        "--append-eod",
        "--workers",
        2,
    )
    ds = IndexedDataset(str(tmp_path / "demo_text_document"))
    assert ds.num_documents == len(docs)
    for engine in ("tokenizers", "tiktoken") if _has_tiktoken() else ("tokenizers",):
        tok = GPT2BPETokenizer(*files, engine=engine)
        for i in (0, len(docs) // 2, len(docs) - 1):
            ids = ds.get_document(i).tolist()
            assert ids == tok.tokenize(docs[i]["text"]) + [0]
            assert tok.detokenize(ids[:-1]) == docs[i]["text"]


def _has_tiktoken():
    import importlib.util

    return importlib.util.find_spec("tiktoken") is not None


def char_shingles(text, n=5):
    text = " ".join(text.lower().split())
    return {text[i : i + n] for i in range(max(1, len(text) - n + 1))}


def test_dedup_finds_planted_near_duplicates(tmp_path):
    rng = np.random.default_rng(0)
    vocab = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), size=rng.integers(3, 9))) for _ in range(3000)]
    texts = [" ".join(rng.choice(vocab, size=200)) for _ in range(60)]
    planted = {}
    for k in range(0, 20, 2):  # a copy of doc k with 1 word in 20 replaced: ~95% identical
        words = texts[k].split()
        for i in range(0, len(words), 20):
            words[i] = rng.choice(vocab)
        planted[len(texts)] = k
        texts.append(" ".join(words))
    texts.append(texts[4])  # an exact copy too: doc 4, its variant and this one form one group
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": t, "url": f"u{i}"}) + "\n" for i, t in enumerate(texts)))
    run_tool(
        "find_duplicates.py",
        "--input",
        corpus,
        "--output",
        tmp_path / "pairs.jsonl",
        "--threshold",
        0.7,
        "--id-key",
        "url",
        "--workers",
        2,
    )
    pairs = read_jsonl(tmp_path / "pairs.jsonl")
    found = {tuple(sorted((int(p["a"][1:]), int(p["b"][1:])))) for p in pairs}
    variant_of_4 = next(v for v, k in planted.items() if k == 4)
    expected = {(k, v) for v, k in planted.items()} | {(4, len(texts) - 1), (variant_of_4, len(texts) - 1)}
    assert found == expected
    for p in pairs:  # the estimate agrees with the exact Jaccard of the shingle sets
        a, b = char_shingles(texts[int(p["a"][1:])]), char_shingles(texts[int(p["b"][1:])])
        assert abs(p["jaccard"] - len(a & b) / len(a | b)) < 0.15
    run_tool("group_duplicates.py", "--input", tmp_path / "pairs.jsonl", "--output", tmp_path / "groups.jsonl")
    groups = sorted(sorted(int(x[1:]) for x in g["group"]) for g in read_jsonl(tmp_path / "groups.jsonl"))
    assert len(groups) == 10 and [4, variant_of_4, len(texts) - 1] in groups
    run_tool(
        "remove_duplicates.py",
        "--input",
        corpus,
        "--groups",
        tmp_path / "groups.jsonl",
        "--output",
        tmp_path / "dedup.jsonl",
        "--id-key",
        "url",
    )
    kept = [d["url"] for d in read_jsonl(tmp_path / "dedup.jsonl")]
    assert kept == [f"u{i}" for i in range(60)]  # originals come first; every copy is removed


def test_dedup_by_line_number_and_word_shingles(tmp_path):
    texts = ["alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu"] * 2 + ["nu xi omicron pi rho"]
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    run_tool("find_duplicates.py", "--input", corpus, "--output", tmp_path / "p.jsonl", "--shingle", "word")
    assert read_jsonl(tmp_path / "p.jsonl") == [{"a": "0", "b": "1", "jaccard": 1.0}]


def test_cleanup(tmp_path):
    english = (
        "This is a plain English paragraph about the way that data is cleaned before it is used for "
        "training a model, and it should be kept by the filter. "
    ) * 3
    docs = [
        {"text": english, "url": "a"},
        {"text": "Le chat est sur la table et il mange une souris dans la cuisine avec plaisir " * 3},
        {"text": "数据清洗是训练语言模型之前的重要步骤" * 5},
        {"text": "Too short for the floor, but English and fine."},
        {"text": english.replace("model", "modelâ€™s")},  # mojibake that ftfy repairs
    ]
    corpus = tmp_path / "raw.jsonl"
    corpus.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs) + "not json\n")
    proc = run_tool(
        "cleanup.py", "--input", corpus, "--output", tmp_path / "clean.jsonl", "--min-tokens", 30, "--workers", 2
    )
    kept = read_jsonl(tmp_path / "clean.jsonl")
    assert [d.get("url") for d in kept] == ["a", None]
    assert "model's" in kept[1]["text"] and "â€" not in kept[1]["text"]  # ftfy also uncurls quotes
    assert "kept 2 of 6" in proc.stderr and "not_english: 2" in proc.stderr and "too_short: 1" in proc.stderr
    assert "unreadable: 1" in proc.stderr


def test_blacklist_urls(tmp_path):
    urls = [
        "https://example.com/article",
        "https://www.youtube.com/watch?v=x",
        "http://i.imgur.com/a.png",
        "https://example.org/paper.PDF",
        "ftp://example.com/x",
        "short",
        "https://example.com/article/",
        "https://blog.example.net/post.html",
        "https://bad.example.net/x",
    ]
    (tmp_path / "urls.txt").write_text("\n".join(urls) + "\n")
    (tmp_path / "domains.txt").write_text("# extra\nbad.example.net\n")
    proc = run_tool(
        "blacklist_urls.py",
        "--input",
        tmp_path / "urls.txt",
        "--output",
        tmp_path / "kept.txt",
        "--domains-file",
        tmp_path / "domains.txt",
    )
    assert (tmp_path / "kept.txt").read_text().split() == [urls[0], urls[7]]
    assert "domain: 3" in proc.stderr and "extension: 1" in proc.stderr and "repeat: 1" in proc.stderr


def test_shuffle_is_a_seeded_permutation(tmp_path):
    lines = [json.dumps({"text": f"doc {i}"}) for i in range(500)]
    (tmp_path / "c.jsonl").write_text("\n".join(lines) + "\n")
    outs = []
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        run_tool(
            "shuffle.py",
            "--input",
            tmp_path / "c.jsonl",
            "--output",
            tmp_path / f"{name}.jsonl",
            "--seed",
            seed,
            "--buckets",
            4,
        )
        outs.append((tmp_path / f"{name}.jsonl").read_text().splitlines())
    assert sorted(outs[0]) == sorted(lines) and outs[0] != lines
    assert outs[0] == outs[1] and outs[0] != outs[2]


def test_bad_command_line_is_one_line_for_every_data_tool_and_tool():
    """A mistyped flag prints one line with a --help hint (QuietArgumentParser), not argparse's usage block."""
    root = Path(__file__).parents[2]
    tools = sorted(f"{folder}/{p.name}" for folder in ("data_tools", "tools") for p in (root / folder).glob("*.py")
                   if not p.name.startswith("_"))
    assert {"data_tools/preprocess.py", "tools/convert_hf.py", "tools/plot_logs.py"} <= set(tools)
    for script in tools:
        proc = run_script(script, "--no-such-flag", check=False)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and "--help" in lines[0], (script, proc.stderr)
