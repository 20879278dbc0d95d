"""DeepSeek-V3's architecture in one tiny model, trained through the command line at every parallel layout, equals
one process (issue 27's proof): ``pretrain_gpt.py`` launched as torchrun starts it (tests/e2e/cli.py's ``launch``).

The model has each DeepSeek-V3 part at once: its first layer dense and its second MoE (``--moe-layer-freq``),
multi-latent attention with a query latent and YaRN, 8 routed experts in 4 groups with sigmoid scores, a top-3
inside the best 2 groups (more experts than the allowed groups hold, as DeepSeek-V3's top-8 in 4 of 8 groups), the
scaling factor, the sequence-level balance loss, the expert bias moved after every step, a shared expert, and one
multi-token prediction depth (an MoE layer, as the main model's last one).

Each layout of ``LAYOUTS`` logs, at every iteration, the lm loss, the ``mtp_1 loss`` and the
``load_balancing_loss`` of the single-process run, and saves (``--save-interval 1``) at every iteration a
checkpoint whose every weight equals the single-process run's (float32 tolerance) and whose expert biases (main
layer and MTP depth) are bitwise the same. One layout resumes from its iteration-2 checkpoint bitwise: the same
logged values and bitwise the same weights and biases at iterations 3 and 4.

Equivalence cannot see a feature that is off in both runs; the single-process run is checked for each: its biases
move at every step, every token's experts lie in 2 of the 4 groups while the same scores without the group limit
would span more, and the MTP depth at position t reads token t+1 and is scored against token t+2 (a probe on its
trained checkpoint: changing one input token or one label moves exactly the positions that definition names).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch

from megatron_like.model.state import load_full_state
from tests.e2e.cli import ISSUE_FLAGS, in_process_run, launch, logged_values

ITERATIONS, RESUME_FROM = 4, 2
NUM_GROUPS, GROUP_TOPK, TOPK = 4, 2, 3
DEEPSEEK_V3 = ISSUE_FLAGS + [
    "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1", "--global-batch-size", "4",
    "--train-iters", str(ITERATIONS), "--eval-iters", "0", "--num-workers", "0",
    "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--ffn-hidden-size", "64",
    "--disable-bias-linear", "--untie-embeddings-and-output-weights",
    # multi-latent attention: query latent 24, key/value latent 16, 8 + 8 rotary query/key features, 12 value
    "--multi-latent-attention", "--q-lora-rank", "24", "--kv-lora-rank", "16", "--qk-head-dim", "8",
    "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12", "--rope-type", "yarn", "--rotary-scaling-factor", "4",
    "--original-max-position-embeddings", "8", "--beta-fast", "4", "--beta-slow", "0.5", "--mscale", "1.0",
    "--mscale-all-dim", "0.5",
    # DeepSeek routing: layer 0 dense, layer 1 (and the MTP depth) MoE
    "--num-experts", "8", "--moe-ffn-hidden-size", "16", "--moe-shared-expert-intermediate-size", "16",
    "--moe-layer-freq", "[0,1]", "--moe-router-topk", str(TOPK), "--moe-router-score-function", "sigmoid",
    "--moe-router-num-groups", str(NUM_GROUPS), "--moe-router-group-topk", str(GROUP_TOPK),
    "--moe-router-topk-scaling-factor", "2.5", "--moe-router-enable-expert-bias",
    "--moe-router-bias-update-rate", "1e-2", "--moe-router-load-balancing-type", "seq_aux_loss",
    "--moe-aux-loss-coeff", "1e-2", "--moe-token-dispatcher-type", "alltoall",
    "--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.3",
]
LOGGED = ("lm loss", "mtp_1 loss", "load_balancing_loss")
ZERO1, ZERO3 = ["--use-distributed-optimizer"], ["--zero-stage", "3"]
# (name, layout flags, processes): every layout issue 27 names, at most 4 processes each.
LAYOUTS: list[tuple[str, list[str], int]] = [
    # tp 2 x dp 2; the experts' own layout etp 1 x ep 2 x expert-dp 2 over the same 4 ranks
    ("tp2-sp-ep2-etp1-zero1", ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                               "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"] + ZERO1, 4),
    # dp 4; each expert split over 2 ranks (etp 2, tp 1), experts over 2 (ep 2)
    ("dp4-ep2-etp2-zero3", ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "2"] + ZERO3, 4),
    # stage 0: embedding and the dense layer; stage 1: the MoE layer, the MTP depth, the output layer
    ("pp2-dp2-zero3", ["--pipeline-model-parallel-size", "2"] + ZERO3, 4),
    # cp 2 (ring) x dp 2, the experts over 2 of the dp x cp ranks (ep 2, expert-dp 2): each cp rank holds half of
    # every sequence (MLA's rope slice, the MTP shift and the sequence-level balance loss's counts cross it)
    ("cp2-p2p-dp2-ep2-zero1", ["--context-parallel-size", "2", "--cp-comm-type", "p2p",
                               "--expert-model-parallel-size", "2"] + ZERO1, 4),
]
RESUMED_LAYOUT = "pp2-dp2-zero3"


def saving(directory: str) -> list[str]:
    return ["--save", directory, "--save-interval", "1"]


def checkpoint_states(directory: str) -> list[dict[str, torch.Tensor]]:
    """The model state (global names, expert biases included) of each iteration's checkpoint, 1 .. ITERATIONS."""
    return [load_full_state(directory, iteration)[1] for iteration in range(1, ITERATIONS + 1)]


def expert_biases(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor for name, tensor in state.items() if name.endswith("router.expert_bias")}


def group_span_recorder(spans: dict[str, int]) -> Callable:
    """``on_chunk`` hook: for every routed micro batch, the most groups a token's experts lie in, as routed
    (``spans["routed"]``) and as the same biased scores would choose without the group limit (``"ungrouped"``)."""
    from megatron_like.model.moe.router import TopKRouter

    def record(router: TopKRouter, args: tuple, output: tuple) -> None:
        tokens, (_, routing_map) = args[0], output
        with torch.no_grad():
            scores = torch.sigmoid(tokens.float() @ router.weight.float().T) + router.expert_bias
            ungrouped = torch.zeros_like(routing_map).scatter_(1, scores.topk(TOPK, dim=-1).indices, True)
        for kind, chosen in (("routed", routing_map), ("ungrouped", ungrouped)):
            groups = chosen.view(chosen.shape[0], NUM_GROUPS, -1).any(dim=-1).sum(dim=-1)  # [T]
            spans[kind] = max(spans.get(kind, 0), int(groups.max()))

    def attach(chunk: torch.nn.Module, _ps) -> None:
        for module in chunk.modules():
            if isinstance(module, TopKRouter):
                module.register_forward_hook(record)

    return attach


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The single-process run (in this process), its logged values and its checkpoint at every iteration."""
    directory = str(tmp_path_factory.mktemp("deepseek_v3_one_process"))
    spans: dict[str, int] = {}
    run = in_process_run(DEEPSEEK_V3 + saving(directory), on_chunk=group_span_recorder(spans))
    logged = {name: dict(enumerate((stats[name] for stats in run["loss_stats"]), start=1)) for name in LOGGED}
    return {"logged": logged, "states": checkpoint_states(directory), "directory": directory, "spans": spans}


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> Callable[[str], dict]:
    """``name`` -> its layout's run (launched once, on first use): stdout, checkpoint directory and states."""
    layouts = {name: (flags, nproc) for name, flags, nproc in LAYOUTS}

    @functools.cache
    def run(name: str) -> dict:
        flags, nproc = layouts[name]
        directory = str(tmp_path_factory.mktemp(name))
        output = launch(nproc, DEEPSEEK_V3 + flags + saving(directory))
        return {"output": output, "directory": directory, "states": checkpoint_states(directory)}

    return run


def assert_same_logged_values(expected: dict[str, dict[int, float]], output: str,
                              iterations: range = range(1, ITERATIONS + 1)) -> None:
    for name in LOGGED:
        logged = logged_values(output, name)
        assert sorted(logged) == list(iterations), f"{name} logged at iterations {sorted(logged)}"
        assert [logged[i] for i in iterations] == pytest.approx([expected[name][i] for i in iterations],
                                                                rel=1e-5), name


def assert_same_state(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor], where: str,
                      tolerance: float = 1e-5) -> None:
    """Every weight within ``tolerance`` (relative and absolute: gpt_runs.assert_same_training's float32 one; 0:
    bitwise), every expert bias bitwise."""
    assert sorted(got) == sorted(expected), f"{where}: {sorted(set(got) ^ set(expected))}"
    for name, tensor in expected.items():
        if name.endswith("router.expert_bias"):
            assert torch.equal(got[name], tensor), f"{where} {name}: {got[name]} != {tensor}"
        else:
            torch.testing.assert_close(got[name], tensor, rtol=tolerance, atol=tolerance,
                                       msg=lambda message, name=name: f"{where} {name}: {message}")


@pytest.mark.parametrize("name", [name for name, _, _ in LAYOUTS])
def test_layout_logs_and_saves_what_one_process_does(reference, launched, name: str) -> None:
    run = launched(name)
    assert_same_logged_values(reference["logged"], run["output"])
    for iteration, (expected, got) in enumerate(zip(reference["states"], run["states"], strict=True), start=1):
        assert_same_state(expected, got, f"{name} iteration {iteration}")


def test_reference_is_deepseek_shaped_and_its_biases_move(reference) -> None:
    """The parts the layouts are compared on are there and live: the dense first layer, MLA's latents, the MoE layer
    and the MTP depth's with a shared expert; both routers' biases change at every step."""
    final = reference["states"][-1]
    assert "layers.0.mlp.fc1.weight" in final and "layers.0.mlp.router.weight" not in final
    assert final["layers.0.attention.q_down.weight"].shape == (24, 64)
    for prefix in ("layers.1.mlp.", "mtp.layers.0.transformer_layer.0.mlp."):
        assert final[prefix + "experts.weight1"].shape[0] == 8 and prefix + "shared_experts.fc1.weight" in final
    biases = [expert_biases(state) for state in reference["states"]]
    assert len(biases[0]) == 2
    previous = {name: torch.zeros_like(bias) for name, bias in biases[0].items()}
    for iteration, step in enumerate(biases, start=1):
        for name, bias in step.items():
            assert not torch.equal(bias, previous[name]), f"{name} did not move at iteration {iteration}"
        previous = step


def test_reference_routes_inside_the_best_groups_and_the_limit_binds(reference) -> None:
    assert reference["spans"]["routed"] <= GROUP_TOPK < reference["spans"]["ungrouped"]


def test_reference_mtp_depth_reads_the_next_token_and_predicts_the_one_after(reference) -> None:
    """On the trained checkpoint: changing input token j changes the LM loss from position j on and the MTP loss
    from j - 1 on (the depth at t embeds token t + 1); changing label j (token j + 1) changes the LM loss at j and the
    MTP loss at j - 1 only (the depth at t is scored against label t + 1, token t + 2)."""
    from megatron_like.inference import load_inference_model
    from megatron_like.parallel_state import ParallelState

    model = load_inference_model(reference["directory"], ParallelState.single_process(torch.device("cpu")),
                                 with_tokenizer=False).model[0]
    generator = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(0, 512, (2, 2, 16), generator=generator)
    positions = torch.arange(16).expand(2, 16)

    with torch.no_grad():
        before = model(ids, positions, labels=labels, with_mtp=True)  # [1 + D, b, s] per-token losses

    def changed_positions(changed_ids: torch.Tensor, changed_labels: torch.Tensor) -> list[list[int]]:
        """The positions whose LM / MTP per-token loss (of either sample) differs from the unchanged batch's."""
        with torch.no_grad():
            after = model(changed_ids, positions, labels=changed_labels, with_mtp=True)
        return [torch.nonzero(row).flatten().tolist() for row in (after != before).any(dim=1)]

    j = 8
    other_ids, other_labels = ids.clone(), labels.clone()
    other_ids[:, j] = (ids[:, j] + 1) % 512
    other_labels[:, j] = (labels[:, j] + 1) % 512
    assert changed_positions(other_ids, labels) == [list(range(j, 16)), list(range(j - 1, 16))]
    assert changed_positions(ids, other_labels) == [[j], [j - 1]]


def test_resume_is_bitwise_with_the_expert_bias(launched, tmp_path) -> None:
    """The RESUMED_LAYOUT run restarted from its iteration-2 checkpoint logs the same values at iterations 3 and 4
    and saves bitwise the same weights and expert biases."""
    from megatron_like.training.checkpointing import write_tracker

    straight = launched(RESUMED_LAYOUT)
    saved_biases = expert_biases(straight["states"][RESUME_FROM - 1])
    assert len(saved_biases) == 2, f"the checkpoint holds the expert biases {sorted(saved_biases)}"
    assert any(bias.abs().sum() > 0 for bias in saved_biases.values())  # a bias to restore
    write_tracker(straight["directory"], RESUME_FROM)  # it saved every iteration: resume from RESUME_FROM
    flags, nproc = next((flags, nproc) for name, flags, nproc in LAYOUTS if name == RESUMED_LAYOUT)
    resumed_directory = str(tmp_path)
    output = launch(nproc, DEEPSEEK_V3 + flags + ["--load", straight["directory"]] + saving(resumed_directory))
    resumed_iterations = range(RESUME_FROM + 1, ITERATIONS + 1)
    straight_logged = {name: logged_values(straight["output"], name) for name in LOGGED}
    for name in LOGGED:
        assert logged_values(output, name) == {i: straight_logged[name][i] for i in resumed_iterations}, name
    for iteration in resumed_iterations:
        assert_same_state(straight["states"][iteration - 1], load_full_state(resumed_directory, iteration)[1],
                          f"resumed iteration {iteration}", tolerance=0.0)
