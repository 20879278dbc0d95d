"""GPT dataset, splits, caching and blending, checked against a plain token-stream reference."""

import os

import numpy as np
import pytest
import torch

from megatron_like.data.blended_dataset import blend_num_samples, parse_data_path
from megatron_like.data.gpt_dataset import build_train_valid_test_datasets, get_split_ranges
from megatron_like.data.indexed_dataset import IndexedDatasetBuilder
from megatron_like.data.masks import get_ltor_documents_and_position_ids
from megatron_like.data.samplers import PretrainingSampler, build_pretraining_data_loader


def make_dataset(path, num_docs, seed=0, base=0):
    """Documents whose tokens say where they come from: doc d holds base + d*1000 + position."""
    rng = np.random.RandomState(seed)
    docs = []
    with IndexedDatasetBuilder(str(path), np.int32) as builder:
        for d in range(num_docs):
            n = int(rng.randint(1, 30))
            doc = base + d * 1000 + np.arange(n)
            docs.append(doc)
            builder.add_document(doc)
    return str(path), docs


class Barrier:
    def __init__(self):
        self.calls = 0

    def __call__(self):
        self.calls += 1


def build(data_path, split="8,1,1", seq=8, seed=1234, samples=(40, 5, 5), cache=None, builder=True, barrier=None):
    return build_train_valid_test_datasets(data_path, split, seq, seed, samples, cache, builder, barrier or Barrier())


def reference_sample(ds, docs, k):
    """Sample k from first principles: shuffle, then cut the doc_idx token stream every seq_length."""
    stream = np.concatenate([docs[d] for d in ds.doc_idx])
    j = int(ds.shuffle_idx[k])
    return stream[j * ds.seq_length : j * ds.seq_length + ds.seq_length + 1]


def test_split_ranges_megatron_rounding():
    assert get_split_ranges("969,30,1", 1000) == [0, 969, 999, 1000]
    assert get_split_ranges("1,1,1", 10) == [0, 4, 7, 10]
    assert get_split_ranges("98,2,0", 10) == [0, 10, 10, 10]
    assert get_split_ranges("100", 7) == [0, 7, 7, 7]
    assert get_split_ranges("8/1/1", 20) == [0, 16, 18, 20]


def test_samples_match_token_stream(tmp_path):
    prefix, docs = make_dataset(tmp_path / "d", 40)
    barrier = Barrier()
    train, valid, test = build([prefix], samples=(300, 20, 10), barrier=barrier)
    assert barrier.calls == 1
    bounds = get_split_ranges("8,1,1", 40)
    for ds, (lo, hi) in zip((train, valid, test), zip(bounds, bounds[1:])):
        assert len(ds) >= ds.spec.num_samples
        assert set(np.unique(ds.doc_idx).tolist()) == set(range(lo, hi))
        for k in range(len(ds)):
            sample = ds[k]["text"]
            assert sample.dtype == np.int64 and sample.shape == (9,)
            np.testing.assert_array_equal(sample, reference_sample(ds, docs, k))
            assert np.all((sample // 1000 >= lo) & (sample // 1000 < hi))  # no leak across splits
    assert len(np.unique(train.doc_idx)) == 32 and len(train.doc_idx) > 32  # several epochs


def test_deterministic_cached_and_seeded(tmp_path):
    prefix, _ = make_dataset(tmp_path / "d", 30)
    train, _, _ = build([prefix])
    cache = tmp_path / "index-cache"
    files = sorted(os.listdir(cache))
    assert len(files) == 12 and all(f.endswith((".npy", ".dsc")) for f in files)
    desc = next(cache.glob(f"{train.spec.paths()['doc'].split(os.sep)[-1][:32]}.dsc")).read_text()
    assert "Dataset name train" in desc and "Random seed 1234" in desc
    mtimes = {f: os.path.getmtime(cache / f) for f in files}
    again, _, _ = build([prefix], builder=False)  # a non-builder rank loads what the builder wrote
    assert {f: os.path.getmtime(cache / f) for f in files} == mtimes
    assert all(np.array_equal(train[i]["text"], again[i]["text"]) for i in range(len(train)))
    other, _, _ = build([prefix], seed=99, cache=str(tmp_path / "c2"))
    assert not np.array_equal(np.asarray(other.shuffle_idx), np.asarray(train.shuffle_idx))


def test_non_builder_without_cache_fails_clearly(tmp_path):
    prefix, _ = make_dataset(tmp_path / "d", 30)
    with pytest.raises(FileNotFoundError, match="index-builder rank"):
        build([prefix], builder=False)


def test_empty_split_is_an_error_not_a_hang(tmp_path):
    prefix, _ = make_dataset(tmp_path / "d", 10)
    barrier = Barrier()
    with pytest.raises(ValueError, match="valid split .* without documents"):
        build([prefix], split="98,2,0", barrier=barrier)
    assert barrier.calls == 0  # raised on every rank before anyone waits


def test_unused_splits_are_none(tmp_path):
    prefix, _ = make_dataset(tmp_path / "d", 10)
    train, valid, test = build([prefix], split="98,2,0", samples=(10, 0, 5))
    assert train is not None and valid is None and test is None


def test_all_empty_documents_is_an_error(tmp_path):
    with IndexedDatasetBuilder(str(tmp_path / "e"), np.int32) as b:
        for _ in range(5):
            b.add_document([])
    with pytest.raises(ValueError, match="only empty documents"):
        build([str(tmp_path / "e")], split="1", samples=(4, 0, 0))


def test_parse_data_path():
    assert parse_data_path(["a"]) == (["a"], None)
    assert parse_data_path(["1", "a", "3", "b"]) == (["a", "b"], [0.25, 0.75])
    assert parse_data_path(["0.3 a 0.7 b"])[0] == ["a", "b"]
    with pytest.raises(ValueError, match="pairs"):
        parse_data_path(["0.3", "a", "b"])
    with pytest.raises(ValueError, match="not a weight"):
        parse_data_path(["a", "b"])
    assert blend_num_samples([0.3, 0.7], 100) == [31, 71]


def test_blending(tmp_path):
    a, docs_a = make_dataset(tmp_path / "a", 30, seed=1)
    b, docs_b = make_dataset(tmp_path / "b", 30, seed=2, base=10**6)
    train, valid, test = build(["0.3", a, "0.7", b], samples=(200, 20, 0))
    assert test is None and len(train) == 200 and len(valid) == 20
    counts = np.bincount(np.asarray(train.dataset_index), minlength=2)
    assert counts.tolist() == [60, 140]
    for i in range(len(train)):
        d, s = int(train.dataset_index[i]), int(train.dataset_sample_index[i])
        sample = train[i]["text"]
        np.testing.assert_array_equal(sample, reference_sample(train.datasets[d], [docs_a, docs_b][d], s))
        assert (sample >= 10**6).all() == (d == 1)
    again, _, _ = build(["0.3", a, "0.7", b], samples=(200, 20, 0), builder=False)
    assert np.array_equal(np.asarray(again.dataset_index), np.asarray(train.dataset_index))


def test_documents_loss_mask_and_position_ids():
    eod = 9
    tokens = torch.tensor([[1, 2, eod, 3, 4], [eod, 5, 6, 7, 8]])
    documents, loss_mask, pos = get_ltor_documents_and_position_ids(
        tokens, eod, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)
    assert pos.tolist() == [[0, 1, 2, 0, 1], [0, 0, 1, 2, 3]]
    assert loss_mask.tolist() == [[1, 1, 0, 1, 1], [0, 1, 1, 1, 1]]
    assert documents.tolist() == [[0, 0, 0, 1, 1], [0, 1, 1, 1, 1]]  # an eod ends its own document
    plain_documents, plain_loss_mask, plain_pos = get_ltor_documents_and_position_ids(tokens, eod)
    assert plain_documents is None and plain_loss_mask.all() and plain_pos[1].tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="need an end-of-document token"):
        get_ltor_documents_and_position_ids(tokens, None, reset_attention_mask=True)


def test_sampler_resumes_and_splits_data_parallel(tmp_path):
    all_batches = [list(PretrainingSampler(20, 0, 2, r, 2)) for r in range(2)]
    assert all_batches[0][:2] == [[0, 1], [4, 5]] and all_batches[1][:2] == [[2, 3], [6, 7]]
    resumed = list(PretrainingSampler(20, 8, 2, 0, 2))
    assert resumed == all_batches[0][2:] and len(PretrainingSampler(20, 8, 2, 0, 2)) == 3
    prefix, _ = make_dataset(tmp_path / "d", 30)
    train, _, _ = build([prefix])
    loader = build_pretraining_data_loader(train, 4, 2, 0, 1)
    first = next(iter(loader))["text"]
    assert first.dtype == torch.int64 and first.shape == (2, 9)
    assert first[0].tolist() == train[4]["text"].tolist()
