"""Packed documents through the command line: with Megatron's --reset-attention-mask --reset-position-ids
--eod-mask-loss, a tiny Llama-style model's first logged loss is that of its documents run one by one.

The data is an indexed dataset of short documents, each ending with the end-of-document token (NullTokenizer: eod is
--vocab-size), so every 32-token sample packs several. The reference rebuilds the same model (weights are drawn by
name, so the same seed gives the launched run's initial weights) and the same first batch, cuts each sample at its
end-of-document tokens, runs every document alone from position 0 with plain causal attention, and averages the
per-token losses over the tokens --eod-mask-loss keeps. The same launch without the reset flags logs another loss,
and at tp2 x pp2 with sequence parallelism (4 ranks: every stage reads its batch's document ids) the same one.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import pretrain_gpt
from megatron_like.config import parse_config
from megatron_like.data.indexed_dataset import IndexedDatasetBuilder
from megatron_like.parallel_state import ParallelState
from tests.e2e.cli import launch, logged_losses

EOD = 127  # NullTokenizer's end-of-document id for --vocab-size 127
FLAGS = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
    "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "1",
    "--lr", "1e-3", "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1", "--seed", "1234",
    "--eval-iters", "0", "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
    "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
    "--untie-embeddings-and-output-weights", "--init-method-std", "0.3",  # large weights: attention matters
    "--tokenizer-type", "NullTokenizer", "--vocab-size", str(EOD), "--split", "100,0,0", "--num-workers", "0",
    "--eod-mask-loss", "--make-vocab-size-divisible-by", "64",  # 128 rows at tp 1 and 2: the same softmax
]
PACKED = ["--reset-attention-mask", "--reset-position-ids"]


def write_documents(prefix: str) -> None:
    """60 documents of 2 to 14 tokens, each followed by the end-of-document token."""
    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(prefix, dtype=np.int32) as builder:
        for _ in range(60):
            builder.add_document(np.append(rng.integers(0, EOD, rng.integers(2, 15)), EOD))


def documents_one_by_one_loss(flags: list[str]) -> float:
    """The first batch's masked mean loss with each document of each sample run through the initial model alone."""
    config = parse_config(flags)
    ps = ParallelState.single_process(torch.device("cpu"))
    model = pretrain_gpt.model_provider(config, ps, layers=range(config.model.num_layers), pre_process=True,
                                        post_process=True, padded_vocab_size=config.padded_vocab_size(EOD + 1))
    train, _, _ = pretrain_gpt.datasets_provider(config, ps, (config.global_batch_size, 0, 0))
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(config.global_batch_size):  # the pretraining sampler's first batch: samples 0, 1, ...
            text = torch.as_tensor(np.asarray(train[i]["text"]), dtype=torch.long)
            tokens, labels = text[:-1], text[1:]
            ends = (tokens == EOD).nonzero().flatten().tolist()
            cuts = [0] + [end + 1 for end in ends] + ([len(tokens)] if not ends or ends[-1] < len(tokens) - 1 else [])
            assert len(cuts) > 3, "a sample should pack several documents"
            for start, stop in zip(cuts[:-1], cuts[1:]):
                ids = tokens[None, start:stop]
                losses = model(ids, torch.arange(stop - start)[None], labels=labels[None, start:stop])[0]
                keep = ids[0] != EOD  # --eod-mask-loss
                total += float(losses[keep].double().sum())
                count += int(keep.sum())
    return total / count


def test_packed_loss_equals_the_documents_run_one_by_one(tmp_path):
    write_documents(str(tmp_path / "docs"))
    data = ["--data-path", str(tmp_path / "docs"), "--data-cache-path", str(tmp_path / "cache")]
    packed = logged_losses(launch(1, FLAGS + PACKED + data))[1]
    expected = documents_one_by_one_loss(FLAGS + PACKED + data)
    assert packed == pytest.approx(expected, rel=2e-5)
    crossing = logged_losses(launch(1, FLAGS + data))[1]  # without the flags attention crosses the documents
    assert abs(crossing - expected) > 1e-3 * expected
    layout = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--sequence-parallel"]
    assert logged_losses(launch(4, FLAGS + PACKED + data + layout))[1] == pytest.approx(expected, rel=2e-5)
