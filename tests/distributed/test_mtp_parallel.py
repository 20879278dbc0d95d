"""Multi-token prediction (two depths) trained through pretrain() equals the single-process run at tp2 with sequence
parallelism (and selective recompute), pp2 (1F1B; and interleaved with an untied output layer, where the last stage
holds its own copy of the word embedding for MTP), dp2 ZeRO-3 with full recompute, and pp2 in bf16 (against one bf16
process, at test_mixed_precision's tolerance): the LM loss, each depth's logged 'mtp_k loss', grad norms and the
updated weights of every parameter (the MTP depths' included). In a DeepSeek-V3-shaped MoE model the depths' layers
are MoE layers (as the main model's last layer): at ep 2 their router losses and expert biases equal one process's too.

The MTP depths sit on the last pipeline stage and look tokens up in the word embedding, which the first stage owns:
with pp2 the last stage's copy must receive the same updates as the first stage's (the embedding group's gradient
all-reduce), else its weights and so the MTP losses drift from one process's.
"""

from __future__ import annotations

import functools
import os
import tempfile

import pytest
import torch

from megatron_like import collectives as comm
from megatron_like.training.checkpointing import write_tracker
from tests.distributed.gpt_runs import assert_same_training, merge_ranks, train_gpt, train_gpt_many
from tests.distributed.harness import run_distributed
from tests.distributed.test_mixed_precision import assert_close_at_precision
from tests.distributed.test_moe_parallel import (
    DEEPSEEK,
    MOE,
    assert_same_expert_biases,
    assert_same_router_losses,
)

MTP = ["--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.3"]
UNTIED = ["--untie-embeddings-and-output-weights"]
CASES = {
    "tp2-sp-recompute-selective": ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                   "--recompute-granularity", "selective"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "untied-pp2-vp2": UNTIED + ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
    "dp2-zero3-recompute-full": ["--zero-stage", "3", "--recompute-granularity", "full", "--recompute-method",
                                 "uniform", "--recompute-num-layers", "1"],
    "bf16-pp2": ["--bf16", "--pipeline-model-parallel-size", "2"],
    # DeepSeek-V3-shaped MoE (first layer dense, sigmoid routing in groups, expert bias, shared expert): the depths'
    # layers are MoE like the main model's last one, their experts split over ep 2 (all-to-all).
    "deepseek-moe-ep2": MOE + DEEPSEEK + ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type",
                                          "alltoall"],
}


@functools.cache
def reference(kind: str = "tied") -> dict:
    """The single-process run a case compares with: "tied" (the default flags), "untied" or "bf16"."""
    extra = {"tied": [], "untied": UNTIED, "bf16": ["--bf16"], "deepseek": MOE + DEEPSEEK}[kind]
    return merge_ranks([train_gpt(0, 1, MTP + extra)])


@functools.cache
def moe_checkpoint() -> str:
    """Where the deepseek-moe-ep2 case saves its last iteration (torch_dist)."""
    return tempfile.mkdtemp(prefix="mtp_moe_ep2_")


@functools.cache
def runs() -> dict[str, dict]:
    flag_lists = [MTP + flags + (["--save", moe_checkpoint(), "--save-interval", "3"] if name == "deepseek-moe-ep2"
                                 else []) for name, flags in CASES.items()]
    per_rank = run_distributed(train_gpt_many, 2, flag_lists, timeout=900)
    return {name: merge_ranks([rank_results[i] for rank_results in per_rank]) for i, name in enumerate(CASES)}


def mtp_losses(run: dict) -> torch.Tensor:
    """``[iterations, 2]``: each iteration's logged 'mtp_1 loss' and 'mtp_2 loss'."""
    return torch.tensor([[stats["mtp_1 loss"], stats["mtp_2 loss"]] for stats in run["loss_stats"]])


@pytest.mark.parametrize("name", list(CASES))
def test_mtp_training_equals_single_process(name: str) -> None:
    run = runs()[name]
    assert "mtp.layers.1.transformer_layer.0.attention.qkv.weight" in run["params"]
    if name.startswith("bf16"):  # bf16 rounds differently per layout: test_mixed_precision's tolerance
        torch.testing.assert_close(mtp_losses(run), mtp_losses(reference("bf16")), rtol=1e-4, atol=0)
        assert_close_at_precision(reference("bf16"), run, "bf16")
        return
    expected = reference(name.split("-")[0] if name.startswith(("untied", "deepseek")) else "tied")
    torch.testing.assert_close(mtp_losses(run), mtp_losses(expected), rtol=1e-5, atol=0)
    assert_same_training(expected, run)


def test_moe_mtp_layers_route_and_balance_like_single_process() -> None:
    """The depths' MoE layers (global indices 4 and 5) have their own router losses and expert biases, updated from
    the counts of both ep ranks' tokens: equal to one process's at every iteration."""
    run, expected = runs()["deepseek-moe-ep2"], reference("deepseek")
    assert "mtp.layers.1.transformer_layer.0.mlp.experts.weight1" in run["params"]
    assert "mtp.layers.0.transformer_layer.0.mlp.shared_experts.fc1.weight" in run["params"]
    assert sorted(expected["expert_biases"][0]) == [1, 2, 3, 4, 5]
    assert any(bias.abs().sum() > 0 for bias in expected["expert_biases"][-1].values())
    assert_same_router_losses(expected, run)
    assert_same_expert_biases(expected, run)


def test_one_process_loads_the_ep2_moe_mtp_checkpoint() -> None:
    """torch_dist saved at ep 2: every weight (each depth's experts whole) and the depths' expert biases load in one
    process as the run left them."""
    from megatron_like.inference import load_inference_model
    from megatron_like.parallel_state import ParallelState

    run = runs()["deepseek-moe-ep2"]
    loaded = load_inference_model(moe_checkpoint(), ParallelState.single_process(torch.device("cpu")),
                                  with_tokenizer=False).model[0]
    named = dict(loaded.named_parameters())
    assert named.keys() == run["params"].keys()
    for name, tensor in named.items():
        torch.testing.assert_close(tensor, run["params"][name], rtol=0, atol=0, msg=name)
    state = loaded.state_dict()
    for depth, layer in enumerate((4, 5)):
        assert torch.equal(state[f"mtp.layers.{depth}.transformer_layer.0.mlp.router.expert_bias"],
                           run["expert_biases"][-1][layer])


def test_mtp_reference_logs_each_depth_and_learns() -> None:
    run = reference()
    assert all(sorted(stats) == ["lm loss", "mtp_1 loss", "mtp_2 loss"] for stats in run["loss_stats"])
    assert [stats["lm loss"] for stats in run["loss_stats"]] == run["losses"]  # the LM loss is logged alone
    losses = mtp_losses(run)
    assert (losses[-1] < losses[0]).all()


# ---------------------------------------------------------------- checkpoints
SAVING = UNTIED + ["--pipeline-model-parallel-size", "2"]
LOADING = {"torch_dist": UNTIED + ["--tensor-model-parallel-size", "2", "--sequence-parallel"], "torch": SAVING}


def straight_then_resumed(rank: int, world_size: int, root: str) -> dict:
    out = {}
    for ckpt_format, loading in LOADING.items():
        directory = os.path.join(root, ckpt_format)
        flags = MTP + ["--ckpt-format", ckpt_format, "--train-iters", "4"]
        straight = train_gpt(rank, world_size, flags + SAVING + ["--save", directory, "--save-interval", "2"])
        if rank == 0:  # the straight run also saved iteration 4: resume from 2
            write_tracker(directory, 2)
        comm.barrier()
        out[ckpt_format] = {"straight": straight, "resumed": train_gpt(rank, world_size, flags + loading + [
            "--load", directory])}
    return out


@pytest.fixture(scope="module")
def checkpoint_runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("mtp_checkpoints")
    results = run_distributed(straight_then_resumed, 2, str(root), timeout=900)
    runs = {fmt: {kind: merge_ranks([r[fmt][kind] for r in results]) for kind in ("straight", "resumed")}
            for fmt in LOADING}
    return {"root": str(root), **runs}


@pytest.mark.parametrize("ckpt_format", list(LOADING))
def test_mtp_checkpoint_resumes_like_the_straight_run(checkpoint_runs, ckpt_format: str) -> None:
    straight, resumed = checkpoint_runs[ckpt_format]["straight"], checkpoint_runs[ckpt_format]["resumed"]
    assert len(straight["losses"]) == 4 and len(resumed["losses"]) == 2
    straight = dict(straight, losses=straight["losses"][2:], grad_norms=straight["grad_norms"][2:],
                    loss_stats=straight["loss_stats"][2:])
    if ckpt_format == "torch":  # the same layout: bitwise
        assert resumed["loss_stats"] == straight["loss_stats"]
    torch.testing.assert_close(mtp_losses(resumed), mtp_losses(straight), rtol=1e-5, atol=0)
    assert_same_training(straight, resumed)


@pytest.mark.parametrize("ckpt_format", list(LOADING))
def test_one_process_loads_the_mtp_checkpoint_for_generation(checkpoint_runs, ckpt_format: str) -> None:
    from megatron_like.inference import load_inference_model
    from megatron_like.parallel_state import ParallelState

    loaded = load_inference_model(os.path.join(checkpoint_runs["root"], ckpt_format),
                                  ParallelState.single_process(torch.device("cpu")), iteration=4, with_tokenizer=False)
    params = checkpoint_runs[ckpt_format]["straight"]["params"]
    named = dict(loaded.model[0].named_parameters())
    assert named.keys() == params.keys() and "mtp.layers.1.eh_proj.weight" in named
    for name, tensor in named.items():
        torch.testing.assert_close(tensor, params[name], rtol=0, atol=0, msg=name)
