"""Multi-token prediction (two depths) trained through pretrain() equals the single-process run at tp2 with sequence
parallelism, pp2 (1F1B; and interleaved with an untied output layer, where the last stage holds its own copy of the
word embedding for MTP), dp2 ZeRO-3 with full recompute: the LM loss, each depth's logged 'mtp_k loss', grad norms
and the updated weights of every parameter (the MTP depths' included).

The MTP depths sit on the last pipeline stage and look tokens up in the word embedding, which the first stage owns:
with pp2 the last stage's copy must receive the same updates as the first stage's (the embedding group's gradient
all-reduce), else its weights and so the MTP losses drift from one process's.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.distributed.gpt_runs import assert_same_training, merge_ranks, train_gpt, train_gpt_many
from tests.distributed.harness import run_distributed

MTP = ["--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.3"]
UNTIED = ["--untie-embeddings-and-output-weights"]
CASES = {
    "tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "untied-pp2-vp2": UNTIED + ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
    "dp2-zero3-recompute-full": ["--zero-stage", "3", "--recompute-granularity", "full", "--recompute-method",
                                 "uniform", "--recompute-num-layers", "1"],
}


@functools.cache
def reference(untied: bool) -> dict:
    return merge_ranks([train_gpt(0, 1, MTP + (UNTIED if untied else []))])


@functools.cache
def runs() -> dict[str, dict]:
    per_rank = run_distributed(train_gpt_many, 2, [MTP + flags for flags in CASES.values()], timeout=900)
    return {name: merge_ranks([rank_results[i] for rank_results in per_rank]) for i, name in enumerate(CASES)}


def mtp_losses(run: dict) -> torch.Tensor:
    """``[iterations, 2]``: each iteration's logged 'mtp_1 loss' and 'mtp_2 loss'."""
    return torch.tensor([[stats["mtp_1 loss"], stats["mtp_2 loss"]] for stats in run["loss_stats"]])


@pytest.mark.parametrize("name", list(CASES))
def test_mtp_training_equals_single_process(name: str) -> None:
    expected, run = reference(name.startswith("untied")), runs()[name]
    assert "mtp.layers.1.transformer_layer.0.attention.qkv.weight" in run["params"]
    torch.testing.assert_close(mtp_losses(run), mtp_losses(expected), rtol=1e-5, atol=0)
    assert_same_training(expected, run)


def test_mtp_reference_logs_each_depth_and_learns() -> None:
    run = reference(False)
    assert all(sorted(stats) == ["lm loss", "mtp_1 loss", "mtp_2 loss"] for stats in run["loss_stats"])
    assert [stats["lm loss"] for stats in run["loss_stats"]] == run["losses"]  # the LM loss is logged alone
    losses = mtp_losses(run)
    assert (losses[-1] < losses[0]).all()
