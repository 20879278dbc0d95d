"""A tiny DeepSeek-style multi-latent attention model (query latent, kv latent, decoupled RoPE slice, YaRN with
both mscale corrections, RMSNorm, SwiGLU, no biases, untied output) trained through pretrain() under tensor
parallelism with and without sequence parallelism, pipeline parallelism with full recompute, data parallelism with
ZeRO-3 and selective recompute, and bf16, equals the single-process run: losses, grad norms and updated weights.

tp 2 without sequence parallelism checks the duplicated down-projections' gradients (every rank's heads add to the
latent's and the shared rope slice's gradient: the all-reduce in the up-projections' entry); with sequence
parallelism each rank applies the down-projections and the latent norms to its own shard, so their weight
gradients are partial sums all-reduced over tp. Every configuration runs in one spawned process group.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.distributed.gpt_runs import (
    assert_same_replicated_masters,
    assert_same_training,
    merge_ranks,
    train_gpt,
    train_gpt_many,
)
from tests.distributed.harness import run_distributed

MLA = [
    "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--ffn-hidden-size", "96",
    "--disable-bias-linear", "--untie-embeddings-and-output-weights",
    "--multi-latent-attention", "--kv-lora-rank", "16", "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "8",
    "--v-head-dim", "12",
    "--rope-type", "yarn", "--rotary-scaling-factor", "4", "--original-max-position-embeddings", "8",
    "--beta-fast", "4", "--beta-slow", "0.5", "--mscale", "1.0", "--mscale-all-dim", "0.5",
]
Q_LATENT = ["--q-lora-rank", "24"]
TP2, PP2, SP, BF16 = ["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"], \
    ["--sequence-parallel"], ["--bf16"]
FULL_RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
SELECTIVE_RECOMPUTE = ["--recompute-granularity", "selective"]

CASES: dict[str, list[str]] = {
    "tp2": Q_LATENT + TP2,
    "tp2-sp": Q_LATENT + TP2 + SP,
    "pp2-recompute-full": Q_LATENT + PP2 + FULL_RECOMPUTE,
    "dp2-zero3-recompute-selective": Q_LATENT + ["--zero-stage", "3"] + SELECTIVE_RECOMPUTE,
    "q-projection-tp2-sp": TP2 + SP,
    "bf16-tp2-sp": BF16 + Q_LATENT + TP2 + SP,
}


@functools.cache
def reference(variant: str = "q-latent") -> dict:
    """The single-process run a case compares with: with the query latent (fp32 or bf16) or without it."""
    extra = {"q-latent": Q_LATENT, "bf16": BF16 + Q_LATENT, "q-projection": []}[variant]
    return merge_ranks([train_gpt(0, 1, MLA + extra)])


@functools.cache
def runs() -> dict[str, dict]:
    names = list(CASES)
    per_rank = run_distributed(train_gpt_many, 2, [MLA + CASES[n] for n in names], timeout=900)
    return {name: merge_ranks([rank_results[i] for rank_results in per_rank]) for i, name in enumerate(names)}


@pytest.mark.parametrize("name", list(CASES))
def test_mla_training_equals_single_process(name: str) -> None:
    run = runs()[name]
    if name.startswith("bf16"):
        # As the Llama test: tp sums bf16 partial products in another order, so the losses are held to 1e-4, the
        # fp32 masters of the tp-replicated weights (norms, the sequence-parallel down-projections) to equality
        # across tp ranks, and the norms' to half an lr step.
        torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(reference("bf16")["losses"]),
                                   rtol=1e-4, atol=0)
        assert_same_replicated_masters(reference("bf16"), run)
    elif name.startswith("q-projection"):
        assert "layers.0.attention.q_proj.weight" in run["params"]
        assert_same_training(reference("q-projection"), run)
    else:
        assert_same_training(reference(), run)


def test_mla_reference_learns_and_has_the_mla_parameters() -> None:
    params = reference()["params"]
    # q: 4 heads * (8 + 8) from the 24-rank latent; kv: 4 heads * (8 + 12) from the 16-rank latent; one 8-wide
    # rope slice beside the kv latent; the output projection reads 4 * 12 value features.
    assert params["layers.0.attention.q_down.weight"].shape == (24, 64)
    assert params["layers.0.attention.q_up.weight"].shape == (64, 24)
    assert params["layers.0.attention.kv_down.weight"].shape == (16 + 8, 64)
    assert params["layers.0.attention.kv_up.weight"].shape == (80, 16)
    assert params["layers.0.attention.proj.weight"].shape == (64, 48)
    assert params["layers.0.attention.kv_norm.weight"].shape == (16,)
    losses = reference()["losses"]
    assert losses[-1] < losses[0]
