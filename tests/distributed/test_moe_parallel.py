"""Mixture of experts (docs/moe.md) trained through pretrain() under expert parallelism equals one process:
losses, router losses (load balancing, z-loss), grad norms and updated weights.

A tiny Mixtral-like model (SwiGLU experts, top-2 of 4, RMSNorm, rope, no biases) whose layers 0, 1 and 3 are
MoE (``--moe-layer-freq`` in Megatron's list form) with a shared expert. All layouts run in one spawned group
of four processes: ep 4 (every rank its own expert), ep 2 inside dp 4 (expert-data-parallel groups of two),
ep 2 x tp 2 with sequence parallelism, ep 2 x pp 2 with virtual stages and full recompute; both
dispatchers; ZeRO 0 to 3; with and without capacity dropping (which needs every layout to drop the same
tokens: capacity is per micro batch and the whole sequence, whatever tp and ep).

Expert tensor parallelism other than tp (the experts' own layout etp x ep x expert-dp over the tp x dp ranks):
etp 1 inside tp 2 (the tp ranks become expert-parallel ranks: ep 2 with expert-dp 2, ep 4 across tp and dp)
and etp 2 with tp 1 (two data-parallel ranks split each expert, the dispatcher gathers their pairs; with and
without ep).

The router's and the experts' other flags at ep 2 x tp 2 with sequence parallelism (docs/moe.md's command),
each against its own single-process run: Sinkhorn routing with the grouped GEMM (alltoall), and softmax before
top-k with position-ordered dropping padded to capacity (allgather).

DeepSeek-V3's routing (sigmoid scores, 8 experts in 4 groups, scaling factor, sequence-level aux loss, the expert
bias moved after every step; first layer dense, shared expert) at ep 2 with etp 1 and 2 (tp 1), ep 2 with etp 1
inside tp 2 + sp, tp 2 + sp and dp 2 x pp 2 with ZeRO-3: losses, router losses and every layer's expert bias at
every iteration equal one process's, and every rank holds the same bias (merge_ranks).
"""

from __future__ import annotations

import functools

import pytest
import torch

from megatron_like.config import ConfigError, parse_config
from tests.distributed.gpt_runs import TRAIN_ITERS, assert_same_training, merge_ranks, train_gpt, train_gpt_many
from tests.distributed.harness import run_distributed

MOE = [
    "--num-attention-heads", "4", "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
    "--ffn-hidden-size", "32", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
    "--num-experts", "4", "--moe-router-topk", "2", "--moe-layer-freq", "[1,1,0,1]",
    "--moe-shared-expert-intermediate-size", "16", "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3",
]
# Capacity 0.5 * 32 tokens * 2 / 4 experts = 8 of the ~16 assignments each expert gets: many are dropped.
CAPACITY = ["--moe-expert-capacity-factor", "0.5"]
ALLTOALL, ALLGATHER = ["--moe-token-dispatcher-type", "alltoall"], ["--moe-token-dispatcher-type", "allgather"]


def ep(size: int) -> list[str]:
    return ["--expert-model-parallel-size", str(size)]


def zero(stage: int) -> list[str]:
    return ["--zero-stage", str(stage)]


def etp(size: int) -> list[str]:
    return ["--expert-tensor-parallel-size", str(size)]


TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]


CASES: dict[str, list[str]] = {
    "ep4-alltoall-zero1": ep(4) + ALLTOALL + zero(1),
    "ep2-dp4-allgather-zero0": ep(2) + ALLGATHER,
    "ep2-dp4-alltoall-zero3-capacity": ep(2) + ALLTOALL + zero(3) + CAPACITY,
    "ep2-tp2-sp-alltoall-zero2-capacity": ep(2) + ALLTOALL + zero(2) + CAPACITY + [
        "--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "ep2-pp2-vp2-allgather-recompute-full": ep(2) + ALLGATHER + [
        "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
        "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
    "etp1-tp2-sp-ep2-alltoall-zero1-capacity": ep(2) + etp(1) + TP2_SP + ALLTOALL + zero(1) + CAPACITY,
    "etp1-tp2-sp-ep2-allgather-zero3": ep(2) + etp(1) + TP2_SP + ALLGATHER + zero(3),
    "etp1-tp2-sp-ep4-alltoall": ep(4) + etp(1) + TP2_SP + ALLTOALL,
    "etp2-tp1-ep2-alltoall-zero3-capacity": ep(2) + etp(2) + ALLTOALL + zero(3) + CAPACITY,
    "etp2-tp1-ep1-allgather-zero2": etp(2) + ALLGATHER + zero(2),
}
# The router's and the experts' other flags, at the layout of docs/moe.md's command (ep 2 x tp 2 with sequence
# parallelism), each against its own single-process run: name -> the model's flags beyond MOE.
VARIANTS: dict[str, list[str]] = {
    "ep2-tp2-sp-alltoall-sinkhorn-grouped-gemm": ["--moe-router-load-balancing-type", "sinkhorn",
                                                  "--moe-grouped-gemm"],
    "ep2-tp2-sp-allgather-pre-softmax-capacity-position-pad": ["--moe-router-pre-softmax"] + CAPACITY + [
        "--moe-token-drop-policy", "position", "--moe-pad-expert-input-to-capacity"],
}
CASES.update({name: flags + ep(2) + TP2_SP + (ALLTOALL if "alltoall" in name else ALLGATHER)
              for name, flags in VARIANTS.items()})
# DeepSeek-V3's routing on a DeepSeek-shaped MoE (first layer dense, 8 experts in 4 groups, top-2 of the best 2
# groups, sigmoid, scaling factor, expert bias moved 1e-2 a step, sequence-level aux loss; MOE's shared expert).
GROUP_LIMIT = ["--moe-router-num-groups", "4", "--moe-router-group-topk", "2"]
DEEPSEEK_UNGROUPED = ["--num-experts", "8", "--moe-layer-freq", "[0,1,1,1]", "--moe-router-score-function", "sigmoid",
                      "--moe-router-topk-scaling-factor", "2.5", "--moe-router-enable-expert-bias",
                      "--moe-router-bias-update-rate", "1e-2", "--moe-router-load-balancing-type", "seq_aux_loss"]
DEEPSEEK = DEEPSEEK_UNGROUPED + GROUP_LIMIT
DEEPSEEK_CASES: dict[str, list[str]] = {
    "deepseek-ep2-etp1-alltoall-zero1": ep(2) + ALLTOALL + zero(1),
    "deepseek-ep2-etp2-tp1-alltoall": ep(2) + etp(2) + ALLTOALL,
    "deepseek-etp1-tp2-sp-ep2-alltoall-zero2": ep(2) + etp(1) + TP2_SP + ALLTOALL + zero(2),
    "deepseek-tp2-sp-allgather": TP2_SP + ALLGATHER,
    "deepseek-dp2-pp2-zero3": ["--pipeline-model-parallel-size", "2"] + zero(3),
}
CASES.update({name: DEEPSEEK + flags for name, flags in DEEPSEEK_CASES.items()})


def model_flags(name: str) -> tuple[str, ...]:
    """The flags of the single-process run case ``name`` equals (its layout flags left out)."""
    if name in DEEPSEEK_CASES:
        return tuple(DEEPSEEK)
    return tuple(VARIANTS.get(name, CAPACITY if "capacity" in name else []))


@functools.cache
def reference(flags: tuple[str, ...] = ()) -> dict:
    return merge_ranks([train_gpt(0, 1, MOE + list(flags))])


@functools.cache
def runs() -> dict[str, dict]:
    names = list(CASES)
    per_rank = run_distributed(train_gpt_many, 4, [MOE + CASES[n] for n in names], timeout=900)
    return {name: merge_ranks([rank_results[i] for rank_results in per_rank]) for i, name in enumerate(names)}


def assert_same_router_losses(reference: dict, run: dict, steps: int = TRAIN_ITERS) -> None:
    names = sorted(reference["moe_losses"][0])  # no load_balancing_loss with sinkhorn
    assert names in (["load_balancing_loss", "z_loss"], ["z_loss"])
    assert [sorted(step) for step in run["moe_losses"]] == [names] * steps
    for name in names:
        torch.testing.assert_close(torch.tensor([step[name] for step in run["moe_losses"]]),
                                   torch.tensor([step[name] for step in reference["moe_losses"]]), rtol=1e-5, atol=0)


def assert_same_expert_biases(reference: dict, run: dict) -> None:
    """The expert bias of every MoE layer equal after every iteration (updated from the same global counts)."""
    assert len(run["expert_biases"]) == len(reference["expert_biases"])
    for step, (expected, got) in enumerate(zip(reference["expert_biases"], run["expert_biases"]), start=1):
        assert sorted(got) == sorted(expected), f"iteration {step}: layers {sorted(got)}"
        for layer, bias in expected.items():
            assert torch.equal(got[layer], bias), f"iteration {step} layer {layer}: {got[layer]} != {bias}"


@pytest.mark.parametrize("name", list(CASES))
def test_moe_training_equals_single_process(name: str) -> None:
    run, expected = runs()[name], reference(model_flags(name))
    assert_same_training(expected, run)
    assert_same_router_losses(expected, run)
    assert_same_expert_biases(expected, run)


def test_deepseek_reference_moves_its_biases_and_its_group_limit_binds() -> None:
    """The DeepSeek cases above are not plain routing in disguise: the single-process run's biases move every
    step (in every MoE layer), and its losses differ from the same model without the group limit."""
    run = reference(tuple(DEEPSEEK))
    assert len(run["expert_biases"]) == TRAIN_ITERS
    for step, biases in enumerate(run["expert_biases"], start=1):
        assert sorted(biases) == [1, 2, 3]
        for bias in biases.values():  # each step moves every expert by -rate, 0 or +rate
            assert bias.abs().max() <= step * 1e-2 + 1e-7 and bias.abs().sum() > 0
    assert abs(reference(tuple(DEEPSEEK_UNGROUPED))["losses"][-1] - run["losses"][-1]) > 1e-4


def test_moe_reference_learns_and_drops_tokens() -> None:
    plain, dropped = reference(), reference(tuple(CAPACITY))
    params = plain["params"]
    assert params["layers.0.mlp.experts.weight1"].shape == (4, 64, 64)  # [experts, h, 2 * ffn (gate, up)]
    assert params["layers.0.mlp.experts.weight2"].shape == (4, 32, 64)
    assert "layers.2.mlp.fc1.weight" in params and "layers.2.mlp.router.weight" not in params  # the dense layer
    assert plain["losses"][-1] < plain["losses"][0]
    # Dropping changes the outputs (the capacity cases above are not the plain model in disguise), and so does
    # each variant's routing (compared with the model that differs from it only there).
    assert abs(dropped["losses"][0] - plain["losses"][0]) > 1e-4
    for name, base in zip(VARIANTS, (plain, dropped), strict=True):
        assert abs(reference(model_flags(name))["losses"][-1] - base["losses"][-1]) > 1e-3, name


def test_expert_layout_is_megatrons_expert_rank_generator() -> None:
    """Within a stage, expert tp is innermost, then ep, then expert-dp (Megatron-core's order tp-ep-dp-pp)."""
    from megatron_like.parallel_state import ParallelState

    def coords(tp: int, dp: int, pp: int, etp: int | None, ep: int) -> list[tuple[int, int, int]]:
        states = [ParallelState(tp_size=tp, dp_size=dp, pp_size=pp, etp_size=etp, ep_size=ep, rank=r)
                  for r in range(tp * dp * pp)]
        for ps in states:
            assert ps.expert_rank_of(ps.etp_rank, ps.ep_rank, ps.expert_dp_rank, ps.pp_rank) == ps.rank
        return [(ps.etp_rank, ps.ep_rank, ps.expert_dp_rank) for ps in states]

    # etp = tp: ep over consecutive data-parallel ranks of one tp rank (the layout before etp existed)
    assert coords(2, 2, 1, None, 2) == [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)]
    # tp 2, etp 1: the two tp ranks of a data-parallel replica are two expert-parallel ranks
    assert coords(2, 2, 1, 1, 2) == [(0, 0, 0), (0, 1, 0), (0, 0, 1), (0, 1, 1)]
    # tp 1, etp 2: two data-parallel ranks split each expert; per pipeline stage
    assert coords(1, 2, 2, 2, 1) == [(0, 0, 0), (1, 0, 0)] * 2
    assert ParallelState(tp_size=2, dp_size=4, etp_size=1, ep_size=4).expert_dp_size == 2


@pytest.mark.parametrize("flags,message", [
    (ep(3) + ["--num-experts", "6"], "does not divide --tensor-model-parallel-size 1 * the data-parallel size 4"),
    (ep(2) + etp(4) + ["--num-experts", "4"], "--expert-model-parallel-size 2 * --expert-tensor-parallel-size 4 "
     "does not divide"),
    (ep(4) + ["--num-experts", "6"], "--num-experts 6 is not divisible by --expert-model-parallel-size 4"),
    (["--num-experts", "4", "--moe-router-topk", "5"], "--moe-router-topk 5 must be in [1, --num-experts 4]"),
    (["--num-experts", "4", "--moe-pad-expert-input-to-capacity"], "needs --moe-expert-capacity-factor"),
    (["--num-experts", "4", "--moe-layer-freq", "[1,0]"], "gives 2 layers but --num-layers is 4"),
    (["--num-experts", "4", "--moe-layer-freq", "__import__('os')"], "--moe-layer-freq"),
    (ep(2), "--expert-model-parallel-size 2 needs --num-experts"),
    (etp(2), "--expert-tensor-parallel-size 2 needs --num-experts"),
    (etp(0) + ["--num-experts", "4"], "--expert-tensor-parallel-size 0 must be positive"),
    (etp(1) + ["--num-experts", "4", "--tensor-model-parallel-size", "2"], "needs --sequence-parallel"),
    (etp(4) + ["--num-experts", "4", "--moe-ffn-hidden-size", "6"],
     "--moe-ffn-hidden-size 6 is not divisible by --expert-tensor-parallel-size 4"),
    (etp(1) + TP2_SP + ["--num-experts", "4", "--save", "/tmp/x", "--ckpt-format", "torch"],
     "--ckpt-format torch cannot save --expert-tensor-parallel-size 1 other than --tensor-model-parallel-size 2; "
     "use --ckpt-format torch_dist"),
    (["--moe-grouped-gemm"], "--moe-grouped-gemm needs --num-experts"),
    (["--num-experts", "6"] + GROUP_LIMIT, "--num-experts 6 is not divisible by --moe-router-num-groups 4"),
    (["--num-experts", "8", "--moe-router-num-groups", "2", "--moe-router-group-topk", "3"],
     "--moe-router-group-topk 3 must be at most --moe-router-num-groups 2"),
    (["--num-experts", "8", "--moe-router-topk", "5"] + GROUP_LIMIT,
     "--moe-router-topk 5 is more than the 4 experts of --moe-router-group-topk 2 groups of 2"),
    (["--num-experts", "8", "--moe-router-group-topk", "2"], "--moe-router-group-topk 2 needs --moe-router-num-groups"),
    (["--num-experts", "8", "--moe-router-enable-expert-bias"],
     "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid"),
    (["--num-experts", "8", "--moe-router-score-function", "sigmoid", "--moe-router-load-balancing-type", "sinkhorn"],
     "--moe-router-score-function sigmoid does not apply to --moe-router-load-balancing-type sinkhorn"),
])
def test_invalid_moe_layouts_are_one_line_errors(flags: list[str], message: str) -> None:
    base = ["--num-layers", "4", "--disable-bias-linear", "--mock-data", "--vocab-size", "64"]
    with pytest.raises(ConfigError) as error:
        parse_config(base + flags, world_size=4)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_torch_dist_checkpoints_take_any_expert_tp() -> None:
    """--save/--load at etp other than tp: torch_dist (the default) stores global tensors; --load of the torch
    format is refused when the checkpoint is read (the format is detected there, test_dist_checkpoint.py)."""
    base = ["--num-layers", "4", "--disable-bias-linear", "--mock-data", "--vocab-size", "64", "--num-experts", "4"]
    for flags in (etp(1) + TP2_SP + ["--save", "/tmp/x", "--load", "/tmp/x"],
                  etp(2) + ["--save", "/tmp/x", "--async-save"], etp(1) + TP2_SP + ["--ckpt-format", "torch",
                                                                                  "--load", "/tmp/x"]):
        config = parse_config(base + flags, world_size=4)
        assert config.parallel.expert_tensor_parallel_size != config.parallel.tensor_model_parallel_size


def test_reshard_tool_writes_the_torch_format_at_etp_equal_to_tp() -> None:
    """tools/checkpoint_reshard.py's torch_dist -> torch pass of a checkpoint saved at etp 1 inside tp 2 runs at
    etp = tp, the only expert layout the torch format's files hold."""
    import sys

    from tests.e2e.cli import ROOT

    sys.path.insert(0, str(ROOT / "tools"))
    import checkpoint_reshard

    base = ["--num-layers", "4", "--disable-bias-linear", "--mock-data", "--vocab-size", "64", "--num-experts", "4"]
    saved = parse_config(base + etp(1) + ep(2) + TP2_SP + ["--save", "/tmp/x"], world_size=4)
    target = checkpoint_reshard.layout_config(saved, 2, 1, None, 2, 0, False)
    assert target.parallel.expert_tensor_parallel_size is None and target.parallel.expert_model_parallel_size == 2


def test_grouped_gemm_flag_is_accepted_and_recorded() -> None:
    config = parse_config(["--disable-bias-linear", "--mock-data", "--vocab-size", "64", "--num-experts", "2",
                           "--moe-grouped-gemm"])
    assert config.model.moe_grouped_gemm and config.to_dict()["model"]["moe_grouped_gemm"]
