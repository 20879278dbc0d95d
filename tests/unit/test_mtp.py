"""Multi-token prediction on one process against a float64 reference written here from DeepSeek-V3's definition.

The reference shares no code with the model: it reads the parameters by name and computes, sample by sample and
position by position, the LM loss and each depth's loss (depth k at position t: the normed previous hidden state
and the normed embedding of token t+k, concatenated and projected, one transformer layer, a final norm, the tied
output layer, cross entropy against token t+k+1, counted where the loss mask of that token is 1). Each depth runs
only over the positions that have a target inside the sample, so the model's padding of the shifted tokens is not
assumed either. Loss and every parameter's gradient must agree, at a point away from the initial weights (every
parameter perturbed) with a loss mask that has holes.
"""

from __future__ import annotations

import math

import pytest
import torch

import pretrain_gpt
from megatron_like.config import ConfigError, ModelConfig, parse_config
from megatron_like.model import GPTModel
from megatron_like.model.state import gather_full_state, load_into_model
from megatron_like.parallel_state import ParallelState

LAYERS, H, HEADS, SEQ, VOCAB, DEPTHS, FACTOR = 2, 32, 4, 8, 64, 2, 0.3


def mtp_config(**overrides) -> ModelConfig:
    values = dict(num_layers=LAYERS, hidden_size=H, num_attention_heads=HEADS, seq_length=SEQ, hidden_dropout=0.0,
                  attention_dropout=0.0, mtp_num_layers=DEPTHS, mtp_loss_scaling_factor=FACTOR)
    values.update(overrides)
    return ModelConfig(**values)


def perturbed_model(config: ModelConfig, **kwargs) -> GPTModel:
    model = GPTModel(config, ParallelState.single_process(torch.device("cpu")), vocab_size=VOCAB, seed=7, **kwargs)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():  # LayerNorms off 1 and 0, biases off 0: nothing hides at init
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    return model


# ---------------------------------------------------------------- the float64 reference


def layer_norm(x: torch.Tensor, p: dict, name: str) -> torch.Tensor:
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + 1e-5) * p[name + ".weight"] + p[name + ".bias"]


def transformer_layer(x: torch.Tensor, p: dict, name: str) -> torch.Tensor:
    """One GPT-2 layer on ``x [n, h]`` (one sample, n positions, causal)."""
    n, hd = x.shape[0], H // HEADS
    qkv = layer_norm(x, p, name + ".ln1") @ p[name + ".attention.qkv.weight"].T + p[name + ".attention.qkv.bias"]
    qkv = qkv.view(n, HEADS, 3, hd)  # per head: its query, key and value (Megatron's grouped layout)
    q, k, v = qkv[:, :, 0].transpose(0, 1), qkv[:, :, 1].transpose(0, 1), qkv[:, :, 2].transpose(0, 1)
    scores = q @ k.transpose(1, 2) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    context = (torch.softmax(scores, -1) @ v).transpose(0, 1).reshape(n, H)
    x = x + context @ p[name + ".attention.proj.weight"].T + p[name + ".attention.proj.bias"]
    hidden = layer_norm(x, p, name + ".ln2") @ p[name + ".mlp.fc1.weight"].T + p[name + ".mlp.fc1.bias"]
    hidden = 0.5 * hidden * (1 + torch.tanh(math.sqrt(2 / math.pi) * (hidden + 0.044715 * hidden**3)))
    return x + hidden @ p[name + ".mlp.fc2.weight"].T + p[name + ".mlp.fc2.bias"]


def reference_losses(p: dict, text: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(LM loss, [mtp_1 loss, ...]) in float64 from parameters ``p`` (global names), ``text [b, SEQ + 1]`` and
    the loss mask ``[b, SEQ]`` of the labels ``text[:, 1:]``."""
    wte = p["embedding.word_embeddings.weight"]
    lm_sum, lm_count = 0.0, 0.0
    depth_sums, depth_counts = [0.0] * DEPTHS, [0.0] * DEPTHS
    for b in range(text.shape[0]):
        x = wte[text[b, :SEQ]] + p["embedding.position_embeddings.weight"][:SEQ]
        for layer in range(LAYERS):
            x = transformer_layer(x, p, f"layers.{layer}")
        hidden = layer_norm(x, p, "final_layernorm")  # h^0: what the output layer sees
        log_probs = torch.log_softmax(hidden @ wte.T, -1)
        for t in range(SEQ):
            if mask[b, t]:
                lm_sum = lm_sum - log_probs[t, text[b, t + 1]]
                lm_count += 1
        for k in range(1, DEPTHS + 1):
            n = SEQ - k  # positions t whose target token t+k+1 lies in the sample
            name = f"mtp.layers.{k - 1}"
            embedded = wte[text[b, k:k + n]]  # tokens t+k
            x = torch.cat([layer_norm(embedded, p, name + ".enorm"), layer_norm(hidden[:n], p, name + ".hnorm")], -1)
            x = transformer_layer(x @ p[name + ".eh_proj.weight"].T, p, name + ".transformer_layer.0")
            hidden = layer_norm(x, p, name + ".final_layernorm")
            log_probs = torch.log_softmax(hidden @ wte.T, -1)
            for t in range(n):
                if mask[b, t + k]:  # the mask of label t+k, i.e. of token t+k+1
                    depth_sums[k - 1] = depth_sums[k - 1] - log_probs[t, text[b, t + k + 1]]
                    depth_counts[k - 1] += 1
    return lm_sum / lm_count, [s / c for s, c in zip(depth_sums, depth_counts)]


# ---------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    text = torch.randint(0, VOCAB, (3, SEQ + 1), generator=generator)
    mask = (torch.rand(3, SEQ, generator=generator) > 0.3).float()
    mask[0, 1] = mask[1, 3] = 0.0  # holes a mask that is not shifted would count
    mask[0, 2] = mask[1, 4] = 1.0
    return text, mask


def test_mtp_loss_and_gradients_equal_the_float64_reference(batch):
    text, mask = batch
    model = perturbed_model(mtp_config())
    positions = torch.arange(SEQ).expand(text.shape[0], SEQ)
    per_token = model(text[:, :-1], positions, labels=text[:, 1:], with_mtp=True)
    assert per_token.shape == (1 + DEPTHS, text.shape[0], SEQ)
    loss, stats = pretrain_gpt.loss_func(mask, per_token, mtp_loss_scaling_factor=FACTOR)
    loss.backward()

    reference_params = {name: p.detach().double().requires_grad_() for name, p in model.named_parameters()}
    lm, depths = reference_losses(reference_params, text, mask)
    expected = lm + FACTOR / DEPTHS * sum(depths)
    expected.backward()
    assert sorted(stats) == ["lm loss"] + [f"mtp_{k} loss" for k in range(1, DEPTHS + 1)]
    torch.testing.assert_close(stats["lm loss"].double(), lm.detach(), rtol=1e-5, atol=0)
    for k, depth in enumerate(depths, start=1):
        torch.testing.assert_close(stats[f"mtp_{k} loss"].double(), depth.detach(), rtol=1e-5, atol=0)
    torch.testing.assert_close(loss.double(), expected.detach(), rtol=1e-5, atol=0)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad.double(), reference_params[name].grad, rtol=1e-4, atol=1e-6,
                                   msg=lambda message, name=name: f"{name}: {message}")


def test_without_with_mtp_the_model_returns_the_next_token_loss_only(batch):
    """Generation and evaluation ignore the MTP depths: the LM loss and logits are the model's without them."""
    text, _ = batch
    model = perturbed_model(mtp_config())
    plain = GPTModel(mtp_config(mtp_num_layers=None), model.ps, vocab_size=VOCAB, seed=7)
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("mtp.")})
    positions = torch.arange(SEQ).expand(text.shape[0], SEQ)
    with torch.no_grad():
        torch.testing.assert_close(model(text[:, :-1], positions, labels=text[:, 1:]),
                                   plain(text[:, :-1], positions, labels=text[:, 1:]), rtol=0, atol=0)
        torch.testing.assert_close(model(text[:, :-1], positions), plain(text[:, :-1], positions), rtol=0, atol=0)


@pytest.mark.parametrize("untied", [False, True])
def test_a_separate_last_stage_gets_the_word_embedding_for_mtp(untied):
    """The last chunk of a pipeline looks MTP tokens up in its copy of the word embedding (the tied output layer,
    or its own copy when untied), which a full state fills from the first stage's embedding."""
    config = mtp_config(untie_embeddings_and_output_weights=untied)
    full = gather_full_state([perturbed_model(config)])
    last = GPTModel(config, ParallelState.single_process(torch.device("cpu")), vocab_size=VOCAB, seed=3,
                    layers=range(1, LAYERS), pre_process=False)
    load_into_model([last], full)
    copy = last.shared_embedding_weight()
    assert copy is not None and copy.shared_embedding
    assert copy is (last.mtp_embedding.weight if untied else last.output_layer.weight)
    torch.testing.assert_close(copy.detach(), full["embedding.word_embeddings.weight"], rtol=0, atol=0)
    assert "mtp_embedding.weight" not in full


def test_mtp_flags_parse_and_the_factor_needs_the_layers():
    data = ["--mock-data", "--vocab-size", "64"]
    config = parse_config(data + ["--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.3"])
    assert (config.model.mtp_num_layers, config.model.mtp_loss_scaling_factor) == (2, 0.3)
    with pytest.raises(ConfigError, match="--mtp-loss-scaling-factor 0.3 needs --mtp-num-layers"):
        parse_config(data + ["--mtp-loss-scaling-factor", "0.3"])
    with pytest.raises(ConfigError, match="--mtp-num-layers 0 must be positive"):
        parse_config(data + ["--mtp-num-layers", "0"])


def test_the_planner_counts_the_mtp_depths():
    """The plan of the last stage holds the depths' parameters (it builds the chunks) and their layers'
    activations."""
    from megatron_like.planning.activations import activation_bytes
    from megatron_like.planning.simulator import count_stage_params

    flags = ["--mock-data", "--vocab-size", "64", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads",
             "4", "--seq-length", "8", "--make-vocab-size-divisible-by", "8"]
    with_mtp, plain = parse_config(flags + ["--mtp-num-layers", "2"]), parse_config(flags)
    vocab = plain.padded_vocab_size(64)
    model = GPTModel(with_mtp.model, ParallelState.single_process(torch.device("cpu")), vocab_size=vocab, seed=0)
    depth_params = sum(p.numel() for p in model.mtp.parameters())
    assert count_stage_params(with_mtp, vocab, 0) - count_stage_params(plain, vocab, 0) == depth_params
    more, less = activation_bytes(with_mtp, 0, vocab, "cpu"), activation_bytes(plain, 0, vocab, "cpu")
    assert more.layers_alive == less.layers_alive + 2 and more.total > less.total


@pytest.mark.parametrize("freq,moe", [("[0,1]", True), ("[1,0]", False)])
def test_the_mtp_layers_are_moe_when_the_main_models_last_layer_is(freq, moe):
    """Megatron-LM's and DeepSeek-V3's rule: a depth's layer has the main model's last layer's kind; an MoE depth
    layer counts among the MoE layers whose router losses are logged (global index num_layers + depth)."""
    config = mtp_config(num_experts=4, moe_router_topk=2, moe_layer_freq=freq, moe_aux_loss_coeff=0.01)
    model = GPTModel(config, ParallelState.single_process(torch.device("cpu")), vocab_size=VOCAB, seed=7)
    assert [type(depth.transformer_layer[0].mlp).__name__ for depth in model.mtp.layers] == [
        "MoELayer" if moe else "MLP"] * DEPTHS
    assert config.moe_layers == ([1, 2, 3] if moe else [0])
