"""The MoE layer's pieces on one process (docs/moe.md): permutation round trips, routing orders, capacity
dropping and padding, the aux-loss autograd hook against the loss added by hand, the logged values, the
experts' stacked weights against per-expert linears, and the MoE layer against a loop over tokens."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_like.config import ModelConfig, parse_moe_layer_freq
from megatron_like.model.moe import aux_losses
from megatron_like.model.moe.moe_layer import MoELayer
from megatron_like.model.moe.permutation import permute, permuted_probs, sort_chunks, unpermute, unsort_chunks
from megatron_like.model.moe.router import (
    TopKRouter,
    drop_over_capacity,
    expert_capacity,
    group_limited_topk,
    sequence_load_balancing_loss,
    switch_load_balancing_loss,
    topk_softmax,
)
from megatron_like.parallel_state import ParallelState


def moe_config(**overrides) -> ModelConfig:
    values = dict(num_layers=2, hidden_size=16, num_attention_heads=2, swiglu=True, ffn_hidden_size=8,
                  disable_bias_linear=True, num_experts=4, moe_router_topk=2)
    values.update(overrides)
    config = ModelConfig(**values)
    config.validate()
    return config


def test_permute_unpermute_is_the_weighted_sum_over_chosen_experts() -> None:
    torch.manual_seed(0)
    tokens, probs = torch.randn(6, 3), torch.rand(6, 4)
    routing_map = torch.rand(6, 4) > 0.5
    permuted, index, counts = permute(tokens, routing_map)
    assert counts.tolist() == routing_map.sum(0).tolist()
    # expert-major: expert 0's tokens first, each expert's in token order
    expected_index = [t for e in range(4) for t in range(6) if routing_map[t, e]]
    assert index.tolist() == expected_index and torch.equal(permuted, tokens[expected_index])
    weights = permuted_probs(probs, routing_map)
    out = unpermute(permuted * 2, index, weights, 6)
    expected = torch.stack([sum((2 * tokens[t] * probs[t, e] for e in range(4) if routing_map[t, e]),
                                torch.zeros(3)) for t in range(6)])
    torch.testing.assert_close(out, expected)


def test_sort_chunks_regroups_sources_by_expert_and_back() -> None:
    counts = torch.tensor([[2, 0, 1], [1, 3, 0]])  # 2 sources x 3 experts
    rows = torch.arange(7.0)[:, None]  # source 0: e0 e0 e2 ; source 1: e0 e1 e1 e1
    sorted_rows, index = sort_chunks(rows, counts)
    assert sorted_rows.flatten().tolist() == [0, 1, 3, 4, 5, 6, 2]  # e0 (s0, s1), e1 (s1), e2 (s0)
    assert torch.equal(unsort_chunks(sorted_rows, index), rows)


def test_topk_orders() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    weights, indices = topk_softmax(logits, 2, pre_softmax=False)
    assert indices.tolist() == [[0, 1]] and torch.allclose(weights.sum(), torch.tensor(1.0))
    weights, _ = topk_softmax(logits, 2, pre_softmax=True)
    torch.testing.assert_close(weights, torch.softmax(logits, -1)[:, :2])


def test_capacity_keeps_the_best_tokens_and_pads_with_unrouted_ones() -> None:
    probs = torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4], [0.7, 0.3]])
    routing_map = torch.tensor([[True, False], [False, True], [True, False], [True, False]])
    assert expert_capacity(4, 2, 1, 1.0) == 2
    kept_probs, kept = drop_over_capacity(probs * routing_map, routing_map, 2, "probs", pad=False)
    assert kept[:, 0].tolist() == [True, False, False, True]  # expert 0 keeps 0.9 and 0.7, drops 0.6
    assert kept[:, 1].tolist() == [False, True, False, False]
    _, kept = drop_over_capacity(probs * routing_map, routing_map, 2, "position", pad=False)
    assert kept[:, 0].tolist() == [True, False, True, False]  # the earliest two
    padded_probs, kept = drop_over_capacity(probs * routing_map, routing_map, 2, "probs", pad=True)
    assert kept.sum(0).tolist() == [2, 2]  # expert 1 filled up with an unrouted token ...
    assert padded_probs[:, 1].tolist() == pytest.approx([0.0, 0.8, 0.0, 0.0])  # ... of weight 0


def test_load_balancing_loss_is_one_when_uniform_and_e_when_collapsed() -> None:
    uniform = torch.full((8, 4), 0.25)
    spread = torch.eye(4, dtype=torch.bool).repeat(2, 1)
    assert switch_load_balancing_loss(uniform, spread, 1).item() == pytest.approx(1.0)
    collapsed = torch.zeros(8, 4).index_fill_(1, torch.tensor([0]), 1.0)
    assert switch_load_balancing_loss(collapsed, collapsed.bool(), 1).item() == pytest.approx(4.0)


def test_aux_and_z_losses_reach_the_router_gradient_like_added_losses() -> None:
    config = moe_config(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
    router = TopKRouter(config, layer=0, seed=1, dtype=torch.float32, device=torch.device("cpu")).train()
    tokens = torch.randn(12, 16, generator=torch.Generator().manual_seed(0))
    aux_losses.reset_aux_losses()
    aux_losses.set_aux_loss_backward_scale(0.5)  # e.g. two micro batches
    probs, _ = router(tokens)
    (0.5 * probs.square().sum()).backward()  # the "main loss" of this micro batch, already divided by 2
    hooked = router.weight.grad.clone()
    router.weight.grad = None
    logits = F.linear(tokens, router.weight)
    p, idx = topk_softmax(logits, 2, False)
    by_hand = torch.zeros_like(logits).scatter(1, idx, p)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, idx, True)
    aux = switch_load_balancing_loss(torch.softmax(logits, -1), routing_map, 2)
    z = torch.logsumexp(logits, -1).square().mean()
    main_only = torch.autograd.grad(0.5 * by_hand.square().sum(), router.weight, retain_graph=True)[0]
    (0.5 * (by_hand.square().sum() + 0.1 * aux + 0.01 * z)).backward()
    torch.testing.assert_close(hooked, router.weight.grad)
    assert (hooked - main_only).abs().max() > 1e-4  # the router losses did contribute
    logged = aux_losses.reduce_aux_losses(["load_balancing_loss", "z_loss"], [0], 1, ParallelState.single_process())
    assert logged == pytest.approx({"load_balancing_loss": aux.item(), "z_loss": z.item()})


def test_experts_and_layer_equal_a_loop_over_tokens() -> None:
    config = moe_config(moe_shared_expert_intermediate_size=8, moe_expert_capacity_factor=0.75)
    ps = ParallelState.single_process(torch.device("cpu"))
    layer = MoELayer(config, ps, layer=0, seed=3, sequence_parallel=False, dtype=torch.float32).eval()
    x = torch.randn(5, 2, 16, generator=torch.Generator().manual_seed(1))
    out = layer(x)
    tokens = x.reshape(10, 16)
    probs, routing_map = layer.router(tokens)
    assert routing_map.sum(0).max() <= math.ceil(0.75 * 10 * 2 / 4)  # capacity held
    w1, w2 = layer.experts.weight1, layer.experts.weight2
    expected = torch.zeros(10, 16)
    for t in range(10):
        for e in range(4):
            if routing_map[t, e]:
                gate_up = tokens[t] @ w1[e]
                expected[t] += probs[t, e] * ((F.silu(gate_up[0::2]) * gate_up[1::2]) @ w2[e])
    expected = expected.view(5, 2, 16) + layer.shared_experts(x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_moe_layer_freq_forms() -> None:
    assert parse_moe_layer_freq("2", 4) == [True, False, True, False]
    assert parse_moe_layer_freq("([1]*3+[0]*1)*2", 8) == [True, True, True, False] * 2


def test_flops_count_the_active_parameters_of_moe_layers() -> None:
    from megatron_like.config import Config
    from megatron_like.model import GPTModel
    from megatron_like.training.metrics import matmul_parameters

    # top-k = E: every expert is active, so the active parameters are all the model's matmul weights (heads of 12
    # features, the attention 24 wide in a 16-wide model, with QK-norms: Qwen3-MoE's shape)
    model_config = moe_config(num_experts=2, moe_router_topk=2, moe_shared_expert_intermediate_size=8,
                              position_embedding_type="rope", normalization="RMSNorm",
                              untie_embeddings_and_output_weights=True, moe_layer_freq="[1,0]", kv_channels=12,
                              qk_layernorm=True)
    model = GPTModel(model_config, ParallelState.single_process(torch.device("cpu")), vocab_size=32, seed=0)
    weights = sum(p.numel() for name, p in model.named_parameters()
                  if "ln" not in name and "layernorm" not in name and "word_embeddings" not in name)
    assert matmul_parameters(Config(model=model_config), 32) == weights
    top1 = Config(model=moe_config(num_experts=2, moe_router_topk=1, moe_layer_freq="[1,0]"))
    assert matmul_parameters(top1, 32) < matmul_parameters(Config(model=moe_config(moe_layer_freq="[1,0]",
                                                                                   num_experts=2)), 32)


def test_no_effect_warnings_of_moe_flags() -> None:
    from megatron_like.config import no_effect_warnings, parse_config

    base = ["--disable-bias-linear", "--mock-data", "--vocab-size", "64", "--num-experts", "2"]
    warnings = no_effect_warnings(parse_config(base + ["--moe-token-dispatcher-type", "alltoall"]))
    assert any("alltoall has no effect" in w for w in warnings)
    assert not no_effect_warnings(parse_config(base))


def test_grouped_gemm_flag_runs_the_kernel_and_equals_the_expert_loop(monkeypatch) -> None:
    """--moe-grouped-gemm: the experts go through kernels.grouped_gemm (one call per linear), same outputs and grads."""
    from megatron_like.model.moe import experts as experts_module

    calls = []
    kernel = experts_module.grouped_gemm
    monkeypatch.setattr(experts_module, "grouped_gemm", lambda *args: calls.append(1) or kernel(*args))
    ps = ParallelState.single_process(torch.device("cpu"))
    x = torch.randn(6, 2, 16, generator=torch.Generator().manual_seed(2))
    results = []
    for grouped in (False, True):
        layer = MoELayer(moe_config(moe_grouped_gemm=grouped), ps, layer=0, seed=3, sequence_parallel=False,
                         dtype=torch.float32)
        out = layer(x)
        out.square().sum().backward()
        results.append((out, layer.experts.weight1.grad, layer.experts.weight2.grad))
    assert len(calls) == 2  # fc1 and fc2 of the grouped layer; none for the loop
    for loop, grouped in zip(*results, strict=True):
        torch.testing.assert_close(grouped, loop, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- DeepSeek-V3 and Qwen3-MoE routing
DEEPSEEK = dict(num_experts=8, moe_router_topk=2, moe_router_score_function="sigmoid", moe_router_num_groups=4,
                moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5, moe_router_enable_expert_bias=True,
                moe_router_bias_update_rate=0.01, moe_router_load_balancing_type="seq_aux_loss")


def deepseek_router(**overrides) -> TopKRouter:
    config = moe_config(**{**DEEPSEEK, **overrides})
    return TopKRouter(config, layer=0, seed=1, dtype=torch.float32, device=torch.device("cpu")).train()


def loop_group_limited_topk(scores: torch.Tensor, topk: int, num_groups: int, group_topk: int) -> list[set[int]]:
    """DeepSeek-V3's rule token by token: groups ranked by the sum of their two best scores, then top-k inside."""
    per_group = scores.shape[1] // num_groups
    chosen = []
    for row in scores.tolist():
        groups = [row[g * per_group:(g + 1) * per_group] for g in range(num_groups)]
        ranked = sorted(range(num_groups), key=lambda g: -sum(sorted(groups[g])[-2:]))[:group_topk]
        allowed = [e for g in ranked for e in range(g * per_group, (g + 1) * per_group)]
        chosen.append(set(sorted(allowed, key=lambda e: -row[e])[:topk]))
    return chosen


def test_group_limited_topk_keeps_the_best_groups_by_their_two_best_scores() -> None:
    scores = torch.rand(64, 8, generator=torch.Generator().manual_seed(5))
    values, indices = group_limited_topk(scores, 2, 4, 2)
    assert [set(row) for row in indices.tolist()] == loop_group_limited_topk(scores, 2, 4, 2)
    torch.testing.assert_close(values, scores.gather(1, indices))
    plain = torch.topk(scores, 2, dim=-1).indices
    assert any(set(a) != set(b) for a, b in zip(indices.tolist(), plain.tolist()))  # the limit did bind
    # one group holding the single best expert loses to two groups of good pairs
    row = torch.tensor([[0.99, 0.0, 0.6, 0.6, 0.55, 0.55, 0.1, 0.1]])
    assert set(group_limited_topk(row, 2, 4, 2)[1][0].tolist()) == {2, 3}


def test_sigmoid_routing_normalizes_the_chosen_scores_and_scales_them() -> None:
    router = deepseek_router(moe_router_num_groups=None, moe_router_group_topk=None,
                             moe_router_enable_expert_bias=False)
    logits = torch.randn(10, 8, generator=torch.Generator().manual_seed(0))
    weights, indices = router.choose(logits)
    top, expected_indices = torch.topk(torch.sigmoid(logits), 2, dim=-1)
    assert torch.equal(indices, expected_indices)
    torch.testing.assert_close(weights, 2.5 * top / top.sum(-1, keepdim=True))


def test_expert_bias_chooses_the_experts_but_not_their_weights() -> None:
    router = deepseek_router(moe_router_num_groups=None, moe_router_group_topk=None)
    assert "expert_bias" in router.state_dict() and "tokens_per_expert" not in router.state_dict()
    assert all(p is not router.expert_bias for p in router.parameters())
    bf16 = TopKRouter(moe_config(**DEEPSEEK), 0, 1, torch.bfloat16, torch.device("cpu"))
    assert bf16.weight.dtype == torch.bfloat16 and bf16.expert_bias.dtype == torch.float32
    logits = torch.randn(10, 8, generator=torch.Generator().manual_seed(0))
    router.expert_bias[5] = 10.0  # every token now picks expert 5 ...
    weights, indices = router.choose(logits)
    assert (indices == 5).any(dim=-1).all()
    scores = torch.sigmoid(logits).gather(1, indices)  # ... weighted by its unbiased score
    torch.testing.assert_close(weights, 2.5 * scores / scores.sum(-1, keepdim=True))


def test_expert_bias_moves_towards_the_experts_below_the_mean_load() -> None:
    from megatron_like.model.moe.expert_bias import update_expert_biases

    ps = ParallelState.single_process(torch.device("cpu"))
    layer = MoELayer(moe_config(**DEEPSEEK), ps, layer=1, seed=3, sequence_parallel=False, dtype=torch.float32)
    router = layer.router
    x = torch.randn(6, 2, 16, generator=torch.Generator().manual_seed(1))
    layer.train()(x)
    counts = router.tokens_per_expert.clone()
    assert counts.sum() == 6 * 2 * 2  # every token's two choices, training only
    layer.eval()(x)
    assert torch.equal(router.tokens_per_expert, counts)
    biases = update_expert_biases([layer], ps)
    expected = 0.01 * torch.sign(counts.mean() - counts)
    assert list(biases) == [1] and torch.equal(biases[1], expected) and torch.equal(router.expert_bias, expected)
    assert expected.abs().sum() > 0 and not router.tokens_per_expert.any()  # moved, and the counter restarts


def test_sequence_aux_loss_is_the_switch_loss_of_each_sequence_averaged() -> None:
    scores = torch.softmax(torch.randn(12, 4, generator=torch.Generator().manual_seed(3)), -1)  # s 6, b 2
    by_sequence = []
    for b in range(2):
        rows = scores[b::2]  # rows are position-major: [s, b] flattened
        chosen = torch.zeros_like(rows, dtype=torch.bool).scatter_(1, rows.topk(2, -1).indices, True)
        by_sequence.append(switch_load_balancing_loss(rows, chosen, 2))
    torch.testing.assert_close(sequence_load_balancing_loss(scores, 2, 2), torch.stack(by_sequence).mean())
    whole = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, scores.topk(2, -1).indices, True)
    torch.testing.assert_close(sequence_load_balancing_loss(scores, 1, 2), switch_load_balancing_loss(scores, whole, 2))
    assert (torch.stack(by_sequence) - switch_load_balancing_loss(scores, whole, 2)).abs().max() > 1e-3


def test_sigmoid_seq_aux_loss_reaches_the_router_gradient_like_an_added_loss() -> None:
    router = deepseek_router(moe_aux_loss_coeff=0.1)
    tokens = torch.randn(12, 16, generator=torch.Generator().manual_seed(0))
    aux_losses.reset_aux_losses()
    aux_losses.set_aux_loss_backward_scale(1.0)
    probs, _ = router(tokens, num_sequences=2)
    probs.square().sum().backward()
    hooked = router.weight.grad.clone()
    router.weight.grad = None
    logits = F.linear(tokens, router.weight)
    weights, indices = router.choose(logits)
    scores = torch.sigmoid(logits)
    aux = sequence_load_balancing_loss(scores / scores.sum(-1, keepdim=True), 2, 2)
    (torch.zeros_like(logits).scatter(1, indices, weights).square().sum() + 0.1 * aux).backward()
    torch.testing.assert_close(hooked, router.weight.grad)


def test_qwen3_moe_normalized_topk_is_the_default_softmax_order() -> None:
    """Hugging Face's Qwen3-MoE (norm_topk_prob): softmax over all experts, top-k, divided by the k's sum."""
    logits = torch.randn(10, 8, generator=torch.Generator().manual_seed(0))
    top, hf_indices = torch.topk(torch.softmax(logits, -1), 2, dim=-1)
    weights, indices = TopKRouter(moe_config(num_experts=8), 0, 1, torch.float32, torch.device("cpu")).choose(logits)
    assert torch.equal(indices, hf_indices)
    torch.testing.assert_close(weights, top / top.sum(-1, keepdim=True))


def test_a_checkpoint_without_expert_bias_loads_with_the_bias_at_zero() -> None:
    """--finetune turning the bias on over a checkpoint trained without it (the torch format loads strictly)."""
    plain = TopKRouter(moe_config(num_experts=8), 0, 1, torch.float32, torch.device("cpu"))
    router = deepseek_router()
    router.expert_bias.fill_(0.5)
    router.load_state_dict(plain.state_dict())
    assert torch.equal(router.weight, plain.weight) and not router.expert_bias.any()
    router.expert_bias.fill_(0.5)
    router.load_state_dict(deepseek_router().state_dict() | {"expert_bias": torch.full((8,), 0.25)})
    assert torch.equal(router.expert_bias, torch.full((8,), 0.25))


def test_moe_layer_gives_the_router_its_sequences_for_seq_aux_loss() -> None:
    """``[s, b, h]`` flattens position-major: the layer tells the router b, so each sequence gets its own loss."""
    ps = ParallelState.single_process(torch.device("cpu"))
    layer = MoELayer(moe_config(**DEEPSEEK), ps, layer=0, seed=3, sequence_parallel=False, dtype=torch.float32).train()
    x = torch.randn(6, 2, 16, generator=torch.Generator().manual_seed(1))
    aux_losses.reset_aux_losses()
    layer(x)
    logged = aux_losses.reduce_aux_losses(["load_balancing_loss"], [0], 1, ps)["load_balancing_loss"]
    scores = torch.sigmoid(F.linear(x.reshape(12, 16), layer.router.weight))
    expected = sequence_load_balancing_loss(scores / scores.sum(-1, keepdim=True), 2, 2)
    assert logged == pytest.approx(expected.item())
    assert logged != pytest.approx(sequence_load_balancing_loss(scores / scores.sum(-1, keepdim=True), 1, 2).item())
