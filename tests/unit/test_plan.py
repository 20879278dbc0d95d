"""The scale simulator against reality: measured peak memory of CPU runs, the schedules' in-flight micro
batches, GPT-3 175B's parameter count, and the exit code of ``tools/plan.py``."""

from __future__ import annotations

import functools
import os
import sys

import pytest

from megatron_like.config import parse_config
from megatron_like.pipeline_parallel.schedules import interleaved_steps, one_f_one_b_steps
from megatron_like.planning.activations import microbatches_alive
from megatron_like.planning.simulator import GIB, plan_run
from tests.peak_memory import peak_live_bytes
from tests.saved_tensors import kept_for_backward

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "256",
         "--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", "2", "--mock-data",
         "--vocab-size", "1024", "--log-interval", "1", "--eval-iters", "0", "--hidden-dropout", "0.1",
         "--attention-dropout", "0.1", "--num-workers", "0"]
GPT3_175B = ["--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96", "--seq-length", "2048",
             "--max-position-embeddings", "2048", "--micro-batch-size", "1", "--global-batch-size", "1536",
             "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16",
             "--num-layers-per-virtual-pipeline-stage", "3", "--sequence-parallel", "--use-distributed-optimizer",
             "--bf16", "--recompute-granularity", "selective", "--vocab-size", "50257", "--mock-data"]


def measured_peak_bytes(flags: list[str]) -> int:
    """Peak bytes of tensors alive at once during a whole single-process run (the profiler's allocation log)."""
    return _measured_peak_bytes(tuple(flags))


@functools.cache
def _measured_peak_bytes(flags: tuple[str, ...]) -> int:
    flags = list(flags)
    import pretrain_gpt
    from megatron_like.training import pretrain

    config = parse_config(flags, world_size=1)
    vocab = config.padded_vocab_size(config.model.vocab_size)
    provider = functools.partial(pretrain_gpt.model_provider, padded_vocab_size=vocab)
    peak, _ = peak_live_bytes(lambda: pretrain(config, provider, pretrain_gpt.forward_step,
                                               pretrain_gpt.datasets_provider, padded_vocab_size=vocab))
    return peak


FOUR_LAYERS = ["--num-layers", "4"]
FULL = ["--recompute-granularity", "full", "--recompute-method"]
RECOMPUTE = {
    "no-recompute": [],
    "selective": ["--recompute-granularity", "selective"],
    "four-layers": FOUR_LAYERS,
    # full recompute of a 4-layer model: only each layer's input kept / the first 2 layers' inputs kept
    "full-uniform": FOUR_LAYERS + FULL + ["uniform", "--recompute-num-layers", "1"],
    "full-block": FOUR_LAYERS + FULL + ["block", "--recompute-num-layers", "2"],
    # every layer MoE (GELU experts), top-2 of 4: the experts' terms, router and fp32 un-permutation copies
    "moe": ["--disable-bias-linear", "--num-experts", "4", "--moe-router-topk", "2"],
}


@pytest.mark.parametrize("mode", list(RECOMPUTE))
def test_simulated_memory_is_within_10_percent_of_the_measured_peak(mode):
    flags = SMALL + RECOMPUTE[mode]
    config = parse_config(flags, world_size=1)
    planned = plan_run(config, config.padded_vocab_size(1024), device="cpu").max_device_bytes
    measured = measured_peak_bytes(flags)
    assert abs(planned - measured) / measured < 0.10, f"planned {planned / 2**20:.1f} MiB, measured " \
                                                       f"{measured / 2**20:.1f} MiB"


@pytest.mark.parametrize("mode", ["full-uniform", "full-block"])
def test_full_recompute_lowers_the_measured_peak(mode):
    """The measured peak falls below the same model's without recompute by at least 3/4 of the saving
    the plan predicts (kept layer activations minus kept inputs)."""
    def planned(flags: list[str]) -> int:
        config = parse_config(flags, world_size=1)
        return plan_run(config, config.padded_vocab_size(1024), device="cpu").max_device_bytes

    without, full = SMALL + RECOMPUTE["four-layers"], SMALL + RECOMPUTE[mode]
    predicted_saving = planned(without) - planned(full)
    measured_saving = measured_peak_bytes(without) - measured_peak_bytes(full)
    assert predicted_saving > 0.2 * planned(without)
    assert measured_saving >= 0.75 * predicted_saving, f"saved {measured_saving / 2**20:.1f} MiB, planned " \
                                                        f"{predicted_saving / 2**20:.1f} MiB"


@pytest.mark.parametrize("pp,vp,m", [(4, 1, 8), (4, 1, 2), (2, 2, 4), (4, 2, 8), (4, 3, 4)])
def test_microbatches_alive_is_the_schedules_peak_of_outstanding_forwards(pp, vp, m):
    layers = 2 * pp * vp
    flags = ["--num-layers", str(layers), "--pipeline-model-parallel-size", str(pp), "--micro-batch-size", "1",
             "--global-batch-size", str(m), "--mock-data", "--vocab-size", "64"]
    if vp > 1:
        flags += ["--num-layers-per-virtual-pipeline-stage", str(layers // (pp * vp))]
    config = parse_config(flags, world_size=pp)
    for pp_rank in range(pp):
        steps = one_f_one_b_steps(pp, pp_rank, m) if vp == 1 else interleaved_steps(pp, pp_rank, m, vp)
        outstanding = peak = 0
        for step in steps:
            outstanding += 1 if step.kind == "F" else -1
            peak = max(peak, outstanding)
        assert microbatches_alive(config, pp_rank) * vp == peak, f"pp rank {pp_rank}"


def test_gpt3_175b_plan_counts_175b_parameters_and_fits_80_gib():
    config = parse_config(GPT3_175B, world_size=1024)
    plan = plan_run(config, config.padded_vocab_size(50257))
    assert abs(plan.total_params - 175e9) / 175e9 < 0.01
    assert len(plan.ranks) == 16
    assert 10 < plan.max_device_bytes / GIB < 80
    # Each stage holds 1/128 of the layers' parameters (tp 8 x pp 16), the first and last a vocabulary slice more.
    assert plan.ranks[0].params > plan.ranks[1].params == plan.ranks[8].params
    assert plan.ranks[0].activations.layers_alive > plan.ranks[15].activations.layers_alive


def test_plan_tool_exits_nonzero_when_a_rank_exceeds_the_device_memory(capsys):
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import plan as plan_tool
    finally:
        sys.path.pop(0)
    assert plan_tool.main(GPT3_175B + ["--world-size", "1024", "--device-memory-gib", "80"]) == 0
    assert "max memory per device:" in capsys.readouterr().out
    assert plan_tool.main(GPT3_175B + ["--world-size", "1024", "--device-memory-gib", "8"]) == 1
    assert "error: pipeline rank 0 needs" in capsys.readouterr().err


LLAMA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--group-query-attention",
         "--num-query-groups", "2", "--disable-bias-linear", "--untie-embeddings-and-output-weights"]
LAYER = ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "64",
         "--micro-batch-size", "4", "--mock-data", "--vocab-size", "1024", "--hidden-dropout", "0",
         "--attention-dropout", "0"]
GQA = ["--group-query-attention", "--num-query-groups", "2"]
WINDOW = ["--window-size", "15,0"]  # 16 keys of 64: the blockwise core, whichever backend, dropout or not
WINDOW_LOCAL = WINDOW + ["--attention-backend", "local"]
QWEN3 = ["--qk-layernorm", "--kv-channels", "64"]  # 8 heads of 64: attention twice the hidden size
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "128"]
MOE_PADDED = MOE + ["--moe-shared-expert-intermediate-size", "64", "--moe-expert-capacity-factor", "0.5",
                    "--moe-pad-expert-input-to-capacity", "--bf16"]
# DeepSeek's multi-latent attention (value heads narrower than query/key heads), with and without the query latent
MLA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
       "--multi-latent-attention", "--q-lora-rank", "96", "--kv-lora-rank", "48", "--qk-head-dim", "32",
       "--qk-pos-emb-head-dim", "16", "--v-head-dim", "24"]
MLA_CASES = {"mla": MLA, "mla-bf16-dropout": MLA + ["--bf16", "--attention-dropout", "0.1"],
             "mla-selective": MLA + ["--recompute-granularity", "selective"],
             "mla-no-q-latent-moe": [f for f in MLA if f not in ("--q-lora-rank", "96")] + MOE}


@pytest.mark.parametrize("extra", [[], ["--bf16"], LLAMA, LLAMA + ["--bf16"], ["--swiglu"], GQA,
                                   ["--position-embedding-type", "rope"], ["--normalization", "RMSNorm"],
                                   ["--normalization", "RMSNorm", "--bf16"], LLAMA + MOE, LLAMA + MOE + ["--bf16"],
                                   LLAMA + MOE_PADDED, ["--disable-bias-linear"] + MOE, LLAMA + WINDOW,
                                   LLAMA + WINDOW_LOCAL + ["--bf16"], GQA + WINDOW,
                                   WINDOW + ["--attention-dropout", "0.1"], LLAMA + QWEN3, LLAMA + QWEN3 + ["--bf16"],
                                   QWEN3, *MLA_CASES.values()],
                         ids=["gpt", "gpt-bf16", "llama", "llama-bf16", "swiglu", "gqa", "rope", "rmsnorm",
                              "rmsnorm-bf16", "mixtral", "mixtral-bf16", "mixtral-shared-padded", "gpt-moe",
                              "mistral-window", "mistral-window-local-bf16", "gqa-window", "gpt-window-dropout",
                              "qwen3", "qwen3-bf16", "gpt-qk-layernorm", *MLA_CASES])
def test_layer_activation_formula_equals_the_tensors_saved_for_backward(extra):
    """What one layer keeps for backward (the autograd saved-tensor hooks, parameters excluded) against the
    planner's per-layer formula, for each architecture option alone and for Llama (with selective recompute: what
    the checkpointed attention core leaves kept)."""
    from megatron_like.planning.activations import layer_activation_bytes

    config = parse_config(LAYER + extra)
    measured = kept_for_backward(config)
    assert layer_activation_bytes(config, config.model.recompute_granularity, "cpu") == pytest.approx(measured,
                                                                                                      rel=0.02)


@pytest.mark.parametrize("extra", [[], ["--bf16", "--attention-dropout", "0.1"]], ids=["fp32", "bf16-dropout"])
def test_mla_packed_documents_activation_formula_equals_the_saved_tensors(extra):
    """Multi-latent attention over packed documents takes the blockwise core (no [s, s] tensor, dropout by hash)."""
    import torch

    from megatron_like.planning.activations import layer_activation_bytes

    config = parse_config(LAYER + MLA + extra)
    # --reset-attention-mask needs end-of-document tokens, which --mock-data lacks: set on the parsed config
    config.data.reset_attention_mask = True
    documents = torch.arange(64).div(10, rounding_mode="floor").expand(4, 64)  # documents of 10 tokens
    assert layer_activation_bytes(config, None, "cpu") == pytest.approx(kept_for_backward(config, documents), rel=0.02)


def test_cpu_log_line_reports_the_peak_of_live_tensors(capsys):
    """On CPU the log's memory figure is the peak of live tensors in a step (not the resident set, which
    glibc inflates): within 10% of the plan, itself checked against the profiler's allocation log above."""
    import re

    import pretrain_gpt
    from megatron_like.training import pretrain

    flags = SMALL + ["--train-iters", "3"]
    config = parse_config(flags, world_size=1)
    vocab = config.padded_vocab_size(1024)
    pretrain(config, functools.partial(pretrain_gpt.model_provider, padded_vocab_size=vocab),
             pretrain_gpt.forward_step, pretrain_gpt.datasets_provider, padded_vocab_size=vocab)
    logged = [float(x) * GIB for x in re.findall(r"max live tensors \(GiB\): ([0-9.]+) \|", capsys.readouterr().out)]
    assert len(logged) == 3
    planned = plan_run(config, vocab, device="cpu").max_device_bytes
    assert abs(logged[-1] - planned) / planned < 0.10, f"logged {logged[-1] / 2**20:.1f} MiB, " \
                                                       f"planned {planned / 2**20:.1f} MiB"


MIXTRAL_TINY = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
                "--micro-batch-size", "1", "--global-batch-size", "8", "--mock-data", "--vocab-size", "128"] + LLAMA + [
                "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48",
                "--moe-layer-freq", "[1,0,1,1]", "--moe-shared-expert-intermediate-size", "16"]


def test_moe_plan_counts_the_built_models_total_and_active_parameters():
    """Total parameters against the single-process model built for real; active ones against the same model
    less the (E - k) experts a token skips in each MoE layer, counted from its expert modules; at ep 2 each rank
    holds half the experts, and their ZeRO shards are over the expert-data-parallel group (dp / ep ranks)."""
    import torch

    from megatron_like.model import GPTModel
    from megatron_like.model.moe import MoELayer
    from megatron_like.parallel_state import ParallelState

    config = parse_config(MIXTRAL_TINY, world_size=1)
    vocab = config.padded_vocab_size(128)
    model = GPTModel(config.model, ParallelState.single_process(torch.device("cpu")), vocab_size=vocab, seed=1)
    total = sum(p.numel() for p in model.parameters())
    moe_layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    assert len(moe_layers) == 3
    skipped = sum((4 - 2) * (layer.experts.weight1[0].numel() + layer.experts.weight2[0].numel())
                  for layer in moe_layers)
    plan = plan_run(config, vocab, device="cpu")
    assert plan.total_params == total
    assert plan.active_params == total - skipped

    expert_params = sum(layer.experts.weight1.numel() + layer.experts.weight2.numel() for layer in moe_layers)
    layout = ["--expert-model-parallel-size", "2", "--use-distributed-optimizer"]
    ep2 = plan_run(parse_config(MIXTRAL_TINY + layout, world_size=4), vocab, device="cpu")  # dp 4, expert-dp 2
    rank = ep2.ranks[0]
    assert rank.expert_params == expert_params // 2
    assert rank.params == total - expert_params // 2
    dense = rank.params - rank.expert_params
    assert rank.optimizer_bytes == pytest.approx(8 * (dense / 4 + rank.expert_params / 2), rel=1e-6)  # fp32 Adam

    # Expert tp 1 inside tp 2 (sequence parallel): a rank holds whole experts, E / ep of them, sharded by ZeRO over
    # tp dp / (etp ep) = 2 ranks; at etp = tp 2 it holds half of each and the expert-dp group is dp / ep = 1 rank.
    tp2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    for etp, held, expert_dp in ((["--expert-tensor-parallel-size", "1"], expert_params // 2, 2),
                                 ([], expert_params // 4, 1)):
        rank = plan_run(parse_config(MIXTRAL_TINY + layout + tp2 + etp, world_size=4), vocab, device="cpu").ranks[0]
        assert rank.expert_params == held
        dense = rank.params - rank.expert_params
        assert rank.optimizer_bytes == pytest.approx(8 * (dense / 2 + held / expert_dp), rel=1e-6)


def test_mla_plan_counts_the_latent_projections_whole_on_every_tp_rank():
    """Multi-latent attention's parameters by hand: at tp 2 a rank holds the down-projections and latent norms whole
    (duplicated) and half of the up- and output projections."""
    h, heads, q_rank, kv_rank, nope, pos, v = 64, 4, 24, 16, 8, 8, 12
    flags = ["--num-layers", "2", "--hidden-size", str(h), "--num-attention-heads", str(heads), "--seq-length", "16",
             "--micro-batch-size", "1", "--global-batch-size", "8", "--mock-data", "--vocab-size", "128",
             "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--ffn-hidden-size", "96",
             "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--multi-latent-attention",
             "--q-lora-rank", str(q_rank), "--kv-lora-rank", str(kv_rank), "--qk-head-dim", str(nope),
             "--qk-pos-emb-head-dim", str(pos), "--v-head-dim", str(v)]
    duplicated = h * q_rank + q_rank + h * (kv_rank + pos) + kv_rank
    split = q_rank * heads * (nope + pos) + kv_rank * heads * (nope + v) + heads * v * h
    mlp_and_norms = 3 * h * 96 + 2 * h
    vocab = parse_config(flags, world_size=1).padded_vocab_size(128)
    outside_layers = 2 * vocab * h + h  # embedding, output layer, final norm
    tp1 = plan_run(parse_config(flags, world_size=1), vocab, device="cpu")
    assert tp1.total_params == 2 * (duplicated + split + mlp_and_norms) + outside_layers
    tp2_flags = flags + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    tp2_config = parse_config(tp2_flags, world_size=2)
    tp2_vocab = tp2_config.padded_vocab_size(128)
    tp2 = plan_run(tp2_config, tp2_vocab, device="cpu")
    mlp_half = 3 * h * 96 // 2 + 2 * h
    assert tp2.ranks[0].params == 2 * (duplicated + split // 2 + mlp_half) + tp2_vocab * h + h


def test_zb_h1_plan_predicts_the_smallest_bubble_at_pp16():
    """GPT-3 175B at pp 16 with 32 micro batches: ZB-V < ZB-H1 (W steps filling the bubble) < interleaved < 1F1B."""
    flags = [f for f in GPT3_175B if f not in ("--num-layers-per-virtual-pipeline-stage", "3")]
    flags[flags.index("--global-batch-size") + 1] = "256"  # dp 8: 32 micro batches of 1

    def bubble(extra: list[str]) -> float:
        config = parse_config(flags + extra, world_size=1024)
        return plan_run(config, config.padded_vocab_size(50257)).bubble

    one_f_one_b = bubble(["--pipeline-schedule", "1f1b"])
    assert one_f_one_b == pytest.approx(15 / (32 + 15))
    zb_h1 = bubble(["--pipeline-schedule", "zb-h1"])
    assert zb_h1 < bubble(["--num-layers-per-virtual-pipeline-stage", "3"]) < one_f_one_b
    # The V schedules (two chunks per rank): ZB-V below ZB-H1, DualPipeV (no overlap on a CPU) at or under it.
    assert bubble(["--pipeline-schedule", "zb-v"]) < zb_h1
    assert bubble(["--pipeline-schedule", "dualpipev"]) <= zb_h1
