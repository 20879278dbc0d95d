"""A Llama-style model (rotary positions, RMSNorm, SwiGLU, grouped-query attention with 4 key/value heads
for 8 query heads, no biases, untied output layer) trained through pretrain() under tensor, sequence,
pipeline (with and without virtual stages) and data parallelism, ZeRO 1/2/3, full and selective
recompute, CPU offload, bf16 and oneDNN's GEMM equals the single-process run: losses, grad norms and updated weights
(fp32: the float32 tolerance of ``assert_same_training``; bf16 with data and pipeline parallelism: the
tolerance of test_mixed_precision; bf16 with tensor parallelism: losses, and the fp32 masters of the norms, see the
test).

tp 4 holds one key/value group of two query heads per rank, tp 2 two groups; sequence parallelism
checks the rotary positions (the whole sequence, not each shard's) and the RMSNorm gradient all-reduce.
"window" adds a sliding window of 6 keys, shorter than the 16-token sequence: every tp rank runs its heads through
the blockwise core over the whole sequence's positions (RoPE scaling changes only the rotary tables, the same on
every rank).
"qwen3" adds Qwen3's QK-norm (--qk-layernorm) and heads of 16 features (--kv-channels 16: attention 128 wide in a
64-wide model): each tp rank normalizes only its own heads, so the norms' weight gradients must be summed over tp
with sequence parallelism and without it (tp2 alone), through pipeline stages, both recomputations and ZeRO-3's
sharded gradients.
Every configuration of one world size runs in one spawned process group.
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
from tests.distributed.test_mixed_precision import assert_close_at_precision

LLAMA = [
    "--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "4",
    "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--ffn-hidden-size", "96",
    "--disable-bias-linear", "--untie-embeddings-and-output-weights",
]
TP2, TP4 = ["--tensor-model-parallel-size", "2"], ["--tensor-model-parallel-size", "4"]
PP2, SP = ["--pipeline-model-parallel-size", "2"], ["--sequence-parallel"]
VP = ["--num-layers-per-virtual-pipeline-stage", "1"]
BF16 = ["--bf16"]
QWEN = ["--add-qkv-bias"]
WINDOW = ["--window-size", "5,0"]
QWEN3 = ["--qk-layernorm", "--kv-channels", "16"]


def zero(stage: int) -> list[str]:
    return ["--zero-stage", str(stage)]


CASES: dict[int, dict[str, list[str]]] = {
    2: {
        "tp2": TP2,
        "tp2-sp": TP2 + SP,
        "pp2-vp2": PP2 + VP,
        "dp2-zero1-recompute-selective": zero(1) + ["--recompute-granularity", "selective"],
        "dp2-zero3-offload": zero(3) + ["--optimizer-cpu-offload"],
        "bf16-dp2-zero1": BF16 + zero(1),
        "qwen-tp2-sp": QWEN + TP2 + SP,
        "bf16-tp2-sp": BF16 + TP2 + SP,
        # oneDNN's GEMM in every linear (auto keeps these tiny ones on MKL) equals the MKL reference.
        "tp2-sp-onednn-gemm": TP2 + SP + ["--cpu-gemm-backend", "onednn"],
        "window-tp2-sp": WINDOW + TP2 + SP,
        "qwen3-tp2": QWEN3 + TP2,
        "qwen3-tp2-sp": QWEN3 + TP2 + SP,
        "qwen3-pp2-recompute-selective": QWEN3 + PP2 + ["--recompute-granularity", "selective"],
    },
    4: {
        "tp4": TP4,
        "tp4-sp": TP4 + SP,
        "tp2-sp-pp2": TP2 + SP + PP2,
        "tp2-sp-dp2-zero2-recompute-full": TP2 + SP + zero(2) + [
            "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2"],
        "pp2-dp2-zero3": PP2 + zero(3),
        "bf16-pp2-dp2-zero3-offload": BF16 + PP2 + zero(3) + ["--optimizer-cpu-offload"],
        "qwen3-tp2-sp-pp2-zero1-recompute-full": QWEN3 + TP2 + SP + PP2 + zero(1) + [
            "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
        "qwen3-tp2-sp-dp2-zero3": QWEN3 + TP2 + SP + zero(3),
        "qwen3-bf16-tp2-sp-pp2": QWEN3 + BF16 + TP2 + SP + PP2,
    },
}


@functools.cache
def reference(precision: str = "fp32") -> dict:
    """The single-process Llama-style run (one per precision; "qwen": with the QKV bias; "window": with the sliding
    window; "qwen3", "qwen3-bf16": with QK-norm and 16-feature heads) cases compare with."""
    extra = {"fp32": [], "bf16": BF16, "qwen": QWEN, "window": WINDOW, "qwen3": QWEN3, "qwen3-bf16": QWEN3 + BF16}[
        precision]
    return merge_ranks([train_gpt(0, 1, LLAMA + extra)])


@functools.cache
def runs(world_size: int) -> dict[str, dict]:
    names = list(CASES[world_size])
    flag_lists = [LLAMA + CASES[world_size][n] for n in names]
    per_rank = run_distributed(train_gpt_many, world_size, flag_lists, timeout=900)
    return {name: merge_ranks([rank_results[i] for rank_results in per_rank]) for i, name in enumerate(names)}


@pytest.mark.parametrize("world_size,name", [(w, n) for w, cases in CASES.items() for n in cases])
def test_llama_training_equals_single_process(world_size: int, name: str) -> None:
    run = runs(world_size)[name]
    if name.startswith(("bf16-tp", "qwen3-bf16")):
        # Tensor parallelism sums bf16 partial products in another order than one process does, so the
        # activations differ by bf16 rounding and Adam turns that noise into lr-sized steps on the few
        # weights with near-zero gradients (rare embedding rows): the losses are held to 1e-4, and the norms'
        # (RMSNorm, QK-norm) fp32 masters to half an lr step, which their sum of gradients over tp decides.
        precision = "qwen3-bf16" if name.startswith("qwen3") else "bf16"
        torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(reference(precision)["losses"]),
                                   rtol=1e-4, atol=0)
        assert_same_replicated_masters(reference(precision), run)
    elif name.startswith("qwen3"):
        assert_same_training(reference("qwen3"), run)
    elif name.startswith("bf16"):
        assert_close_at_precision(reference("bf16"), run, "bf16")
    elif name.startswith("window"):
        assert reference("window")["losses"][0] != reference()["losses"][0]  # the window is on
        assert_same_training(reference("window"), run)
    elif name.startswith("qwen"):
        assert "layers.0.attention.qkv.bias" in run["params"]
        assert_same_training(reference("qwen"), run)
    else:
        assert_same_training(reference(), run)


def test_llama_reference_learns_and_has_the_llama_parameters() -> None:
    params = reference()["params"]
    assert "embedding.position_embeddings.weight" not in params and "output_layer.weight" in params
    assert not any(name.endswith(".bias") for name in params)
    # QKV: (8 query + 2 * 4 key/value heads) * head dim 8; fc1: (gate, up) pairs of 96 features.
    assert params["layers.0.attention.qkv.weight"].shape == (128, 64)
    assert params["layers.0.mlp.fc1.weight"].shape == (192, 64)
    losses = reference()["losses"]
    assert losses[-1] < losses[0]


def test_qwen3_reference_has_trained_qk_norms_and_wide_heads() -> None:
    """The QK-norm weights exist, one [head_dim] each per layer, and training moved them (their gradient reached
    them), so the parallel runs above compare weights that matter."""
    params = reference("qwen3")["params"]
    for name in ("q_layernorm", "k_layernorm"):
        weight = params[f"layers.0.attention.{name}.weight"]
        assert weight.shape == (16,) and not torch.equal(weight, torch.ones(16))
    # QKV: (8 query + 2 * 4 key/value heads) * 16 features; the output projection maps 8 * 16 back to 64.
    assert params["layers.0.attention.qkv.weight"].shape == (256, 64)
    assert params["layers.0.attention.proj.weight"].shape == (64, 128)
