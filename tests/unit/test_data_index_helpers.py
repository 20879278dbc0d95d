"""doc/sample/shuffle/blending indices: numpy and C++ paths against Megatron's loops and hand values."""

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from megatron_like.data import index_helpers

SOURCE = Path(__file__).resolve().parents[2] / "csrc" / "dataset_helpers.cpp"


@pytest.fixture(scope="session")
def compiled(request):
    """The C++ helpers: the installed extension, else compiled here (cached by source hash)."""
    try:
        from megatron_like._csrc import dataset_helpers

        return dataset_helpers
    except ImportError:
        pass
    import pybind11  # a build requirement (pyproject.toml): missing is a broken setup, not a skip
    compiler = shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    digest = hashlib.sha1(SOURCE.read_bytes()).hexdigest()[:12]
    out_dir = Path(request.config.cache.mkdir(f"dataset_helpers-{digest}"))
    out = out_dir / ("dataset_helpers" + sysconfig.get_config_var("EXT_SUFFIX"))
    if not out.exists():
        tmp = out.with_suffix(f".tmp{os.getpid()}")
        cmd = [
            compiler,
            "-O2",
            "-shared",
            "-fPIC",
            "-std=c++17",
            f"-I{pybind11.get_include()}",
            f"-I{sysconfig.get_paths()['include']}",
            str(SOURCE),
            "-o",
            str(tmp),
        ]
        subprocess.run(cmd, check=True, capture_output=True)
        os.replace(tmp, out)
    spec = importlib.util.spec_from_file_location("dataset_helpers", out)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(params=["numpy", "csrc"])
def engine(request, monkeypatch):
    """Run the test once with the numpy fallback (forced by the env) and once with the C++ helper."""
    if request.param == "numpy":
        monkeypatch.setenv("MEGATRON_LIKE_NO_CSRC", "1")
        assert index_helpers.csrc_helpers() is None
    else:
        monkeypatch.delenv("MEGATRON_LIKE_NO_CSRC", raising=False)
        monkeypatch.setattr(index_helpers, "_csrc_module", request.getfixturevalue("compiled"))
        assert index_helpers.csrc_helpers() is not None
    return request.param


def megatron_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch):
    """Megatron-LM's _build_sample_idx, transcribed loop for loop (the reference)."""
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    sample_idx = np.zeros([num_samples + 1, 2], dtype=np.int64)
    sample_index, doc_idx_index, doc_offset = 1, 0, 0
    while sample_index <= num_samples:
        remaining = seq_length + 1
        while remaining != 0:
            doc_length = sizes[doc_idx[doc_idx_index]] - doc_offset
            remaining -= doc_length
            if remaining <= 0:
                doc_offset += remaining + doc_length - 1
                remaining = 0
            else:
                doc_idx_index += 1
                doc_offset = 0
        sample_idx[sample_index] = (doc_idx_index, doc_offset)
        sample_index += 1
    return sample_idx


def megatron_num_epochs(tokens_per_epoch, seq_length, num_samples):
    epochs, total = 0, 0
    while True:
        epochs += 1
        total += tokens_per_epoch
        if (total - 1) // seq_length >= num_samples:
            return epochs


def megatron_blending(weights, size):
    counts = [0] * len(weights)
    index, sample = [], []
    for i in range(size):
        errors = [w * max(i, 1) - c for w, c in zip(weights, counts)]
        d = int(np.argmax(errors))  # first maximum, like the strict '>' in Megatron's C++
        index.append(d)
        sample.append(counts[d])
        counts[d] += 1
    return index, sample


def test_hand_computed_sample_idx(engine):
    sizes = np.array([3, 4], dtype=np.int32)
    doc_idx = np.array([0, 1], dtype=np.int32)
    got = index_helpers.build_sample_idx(sizes, doc_idx, 2, 1, 7)
    assert got.tolist() == [[0, 0], [0, 2], [1, 1], [1, 3]]


@pytest.mark.parametrize("seq_length", [1, 2, 3, 7, 16, 64])
def test_sample_idx_matches_megatron_loop(engine, seq_length):
    rng = np.random.RandomState(seq_length)
    sizes = rng.randint(0, 25, size=40).astype(np.int32)  # includes empty documents
    sizes[0] = 0
    epochs = 3
    doc_idx = index_helpers.build_doc_idx(np.arange(40), epochs, rng, separate_last_epoch=True)
    tokens = int(sizes.sum())
    got = index_helpers.build_sample_idx(sizes, doc_idx, seq_length, epochs, tokens)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, megatron_sample_idx(sizes, doc_idx, seq_length, epochs, tokens))


@pytest.mark.parametrize("tokens,seq,samples", [(10, 4, 0), (10, 4, 2), (10, 4, 3), (7, 1, 100), (1000, 128, 5)])
def test_num_epochs_matches_megatron(tokens, seq, samples):
    assert index_helpers.num_epochs_needed(tokens, seq, samples) == megatron_num_epochs(tokens, seq, samples)


def test_num_epochs_rejects_empty_split():
    with pytest.raises(ValueError, match="no tokens"):
        index_helpers.num_epochs_needed(0, 8, 10)


def test_doc_idx_is_epochs_of_the_documents():
    rng = np.random.RandomState(1)
    docs = np.arange(5, 12)
    doc_idx = index_helpers.build_doc_idx(docs, 4, rng, separate_last_epoch=True)
    assert doc_idx.dtype == np.int32 and len(doc_idx) == 28
    assert sorted(doc_idx[-7:].tolist()) == docs.tolist()  # the last epoch is shuffled on its own
    assert np.bincount(doc_idx)[5:].tolist() == [4] * 7


def test_shuffle_idx_shuffles_parts_separately():
    s = index_helpers.build_shuffle_idx(6, 9, np.random.RandomState(0))
    assert s.dtype == np.uint32
    assert sorted(s[:6].tolist()) == list(range(6)) and sorted(s[6:].tolist()) == [6, 7, 8]


@pytest.mark.parametrize(
    "weights,size",
    [
        ([0.5, 0.5], 10),
        ([0.3, 0.7], 1000),
        ([0.1, 0.2, 0.3, 0.4], 997),
        ([1 / 3, 1 / 3, 1 / 3], 300),
        ([0.0, 1.0], 5),
    ],
)
def test_blending_matches_greedy_rule(engine, weights, size):
    index, sample = index_helpers.build_blending_indices(np.array(weights), size)
    ref_index, ref_sample = megatron_blending(weights, size)
    assert index.dtype == np.int16 and sample.dtype == np.int64
    assert index.tolist() == ref_index and sample.tolist() == ref_sample
    counts = np.bincount(index, minlength=len(weights))
    assert np.all(np.abs(counts - np.array(weights) * size) <= 1.0)


def test_blending_hand_example(engine):
    index, sample = index_helpers.build_blending_indices(np.array([0.25, 0.75]), 8)
    # errors per step: i=0 (.25, .75) -> 1; i=1 (.25, -.25) -> 0; i=2 (-.5, .5) -> 1;
    # i=3 (-.25, .25) -> 1; i=4 (0, 0) tie -> 0; i=5 (-.75, .75) -> 1; i=6, i=7 -> 1
    assert index.tolist() == [1, 0, 1, 1, 0, 1, 1, 1]
    assert sample.tolist() == [0, 0, 1, 2, 1, 3, 4, 5]


def test_missing_extension_warns_and_falls_back(monkeypatch):
    monkeypatch.delenv("MEGATRON_LIKE_NO_CSRC", raising=False)
    monkeypatch.setattr(index_helpers, "_csrc_module", index_helpers._CSRC_UNSET)
    monkeypatch.setitem(sys.modules, "megatron_like._csrc", None)  # makes the import fail
    with pytest.warns(UserWarning, match="numpy fallback"):
        assert index_helpers.csrc_helpers() is None
