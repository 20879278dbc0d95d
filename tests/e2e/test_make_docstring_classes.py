"""data_tools/make_docstring_classes.py: standard-library docstrings labeled by their package, split by file."""

from __future__ import annotations

import json

from megatron_like.data.classification_dataset import read_sentence_pairs
from tests.e2e.cli import run_data_tool


def test_docstrings_labeled_by_package_and_split_by_source_file(tmp_path):
    run_data_tool("make_docstring_classes.py", "--output-dir", tmp_path, "--num-classes", "4")
    classes = (tmp_path / "classes.txt").read_text().split()
    assert len(classes) == 4 and len(set(classes)) == 4
    rows = {split: [json.loads(line) for line in (tmp_path / f"{split}.jsonl").read_text("utf-8").splitlines()]
            for split in ("train", "dev")}
    for split, examples in rows.items():
        assert {e["label"] for e in examples} == set(range(4)), split  # every class on both sides
        for e in examples:  # the label is the package of the file the docstring comes from
            assert e["source"].split("/", 1)[0] == classes[e["label"]], e
            assert e["sentence2"] == "" and len(e["sentence1"]) >= 80
    train_files = {e["source"] for e in rows["train"]}
    dev_files = {e["source"] for e in rows["dev"]}
    assert not train_files & dev_files  # dev docstrings come from files the fine-tune never reads
    assert 0.1 < len(rows["dev"]) / (len(rows["train"]) + len(rows["dev"])) < 0.4
    # The fine-tune reads it as it is (one text per example: sentence2 empty).
    assert len(read_sentence_pairs(str(tmp_path / "dev.jsonl"))) == len(rows["dev"])
