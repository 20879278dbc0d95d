"""Hugging Face Qwen3 and Qwen3-MoE <-> our checkpoints (megatron_like/inference/hf_qwen3.py and tools/convert_hf.py),
on tiny random ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` models built from a config (nothing downloaded).

The tiny models have heads of 32 features in a 64-wide model (``--kv-channels``) and random QK-norm weights: with
HF's initial weights of 1 the norm would commute with RoPE (a rotation keeps the RMS), so a norm applied after
RoPE would pass unnoticed. from-hf writes tp1 and tp2 x pp2 checkpoints whose logits, read back in one process,
equal transformers'; greedy generation through our KV cache gives transformers' tokens; to-hf gives back the
same tensors bit for bit. The MoE model has one dense layer (``mlp_only_layers``) and is checked with and without
``norm_topk_prob`` (our default top-k order and ``--moe-router-pre-softmax``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers  # a test dependency: missing, these tests fail

from megatron_like.inference import hf_gpt2, hf_qwen3, load_inference_model
from megatron_like.model import GPTModel
from megatron_like.parallel_state import ParallelState
from tests.unit.test_hf_llama import IDS, LOGIT_ATOL, assert_greedy_equals_hf, convert_hf, converted_layouts

H, HEADS, GROUPS, HEAD_DIM, FFN, LAYERS, VOCAB = 64, 4, 2, 32, 96, 2, 120
EXPERTS, TOPK, EXPERT_FFN = 4, 2, 48


def tiny_qwen3(moe: bool = False, **overrides):
    """A tiny random Qwen3ForCausalLM (Qwen3MoeForCausalLM with ``moe``: layer 1 dense), large init so attention,
    routing and every expert matter, and QK-norm weights drawn around 1."""
    values = dict(hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=GROUPS, head_dim=HEAD_DIM,
                  intermediate_size=FFN, num_hidden_layers=LAYERS, vocab_size=VOCAB, rope_theta=1000000.0,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=64, initializer_range=0.3)
    if moe:
        values.update(num_experts=EXPERTS, num_experts_per_tok=TOPK, moe_intermediate_size=EXPERT_FFN,
                      norm_topk_prob=True, mlp_only_layers=[1], router_aux_loss_coef=0.001)
    values.update(overrides)
    torch.manual_seed(0)
    name = "Qwen3Moe" if moe else "Qwen3"
    model = getattr(transformers, f"{name}ForCausalLM")(getattr(transformers, f"{name}Config")(**values)).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith(("q_norm.weight", "k_norm.weight")):
                param.normal_(1.0, 0.5)
    return model


def ours_from(hf, directory) -> GPTModel:
    """Our one-process model holding ``hf``'s weights (through hf_qwen3's config and state mapping), read from
    ``hf`` saved in ``directory``: transformers holds a Qwen3-MoE layer's experts fused in memory and writes the
    published per-expert tensors."""
    hf.save_pretrained(directory)
    cfg, state = hf_gpt2.read_hf_dir(str(directory))
    config = hf_qwen3.model_config_from_hf(cfg)
    config.validate()
    model = GPTModel(config, ParallelState.single_process(torch.device("cpu")), vocab_size=VOCAB, seed=1)
    model.load_state_dict(hf_qwen3.from_hf_state(state, config, VOCAB))
    return model.eval()


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe"])
def qwen3_dirs(request, tmp_path_factory):
    """(HF model, its directory, our tp1 and tp2 x pp2 checkpoints converted from it, to-hf of the latter)."""
    root = tmp_path_factory.mktemp(request.param)
    hf = tiny_qwen3(moe=request.param == "qwen3_moe")
    return hf, converted_layouts(hf, root)


@pytest.mark.parametrize("layout", ["tp1", "tp2pp2"])
def test_from_hf_keeps_the_logits(qwen3_dirs, layout):
    hf, dirs = qwen3_dirs
    loaded = load_inference_model(dirs[layout], ParallelState.single_process(torch.device("cpu")))
    m = loaded.config.model
    assert (m.qk_layernorm, m.head_dim, m.attention_size, m.query_groups, m.rotary_base, m.norm_epsilon) == (
        True, HEAD_DIM, HEADS * HEAD_DIM, GROUPS, 1000000, 1e-6)
    if hf.config.model_type == "qwen3_moe":
        assert (m.num_experts, m.moe_router_topk, m.moe_ffn_size, m.ffn_size) == (EXPERTS, TOPK, EXPERT_FFN, FFN)
        assert m.moe_layer_pattern == [True, False] and not m.moe_router_pre_softmax
    with torch.no_grad():
        torch.testing.assert_close(loaded.model[0](IDS, None)[..., :VOCAB], hf(IDS).logits, rtol=1e-5,
                                   atol=LOGIT_ATOL)


def test_to_hf_round_trip_gives_the_same_tensors_and_logits(qwen3_dirs):
    hf, dirs = qwen3_dirs
    _, original = hf_gpt2.read_hf_dir(dirs["hf"])
    config, converted = hf_gpt2.read_hf_dir(dirs["back"])
    assert config["architectures"] == [hf_qwen3.FAMILIES[hf.config.model_type]]
    assert "model.layers.1.self_attn.k_norm.weight" in converted
    assert sorted(converted) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(converted[name], tensor), name
    back = transformers.AutoModelForCausalLM.from_pretrained(dirs["back"]).eval()
    assert type(back) is type(hf) and back.config.head_dim == HEAD_DIM
    with torch.no_grad():
        torch.testing.assert_close(back(IDS).logits, hf(IDS).logits, rtol=0, atol=0)


@pytest.mark.parametrize("variant", ["qwen3", "qwen3_moe", "qwen3_moe-no-norm-topk"])
def test_greedy_generation_through_the_kv_cache_equals_transformers(variant, tmp_path):
    """Left-padded prompts of 9 and 3 tokens, 12 new tokens each: the cached keys are normalized and rotated once,
    when stored. Without norm_topk_prob the router keeps the softmax over all experts (--moe-router-pre-softmax)."""
    hf = tiny_qwen3(moe=variant != "qwen3", **({"norm_topk_prob": False} if variant.endswith("no-norm-topk") else {}))
    ours = ours_from(hf, tmp_path)
    assert ours.config.moe_router_pre_softmax == variant.endswith("no-norm-topk")
    with torch.no_grad():
        torch.testing.assert_close(ours(IDS, None), hf(IDS).logits, rtol=1e-5, atol=LOGIT_ATOL)
    assert_greedy_equals_hf(ours, hf)
    config = hf_qwen3.hf_config(ours.config, VOCAB)
    assert config["norm_topk_prob" if variant != "qwen3" else "model_type"] == {
        "qwen3": "qwen3", "qwen3_moe": True, "qwen3_moe-no-norm-topk": False}[variant]


@pytest.mark.parametrize("flag,value,message", [
    ("qk_layernorm", False, "without --qk-layernorm"),
    ("add_qkv_bias", True, "--add-qkv-bias"),
    ("window_size", "7,0", "--window-size 7,0"),
    ("moe_shared_expert_intermediate_size", 16, "--moe-shared-expert-intermediate-size"),
    ("moe_expert_capacity_factor", 1.0, "--moe-expert-capacity-factor"),
    ("moe_router_load_balancing_type", "sinkhorn", "sinkhorn"),
])
def test_models_qwen3_cannot_hold_are_refused_in_one_line(flag, value, message):
    model = dataclasses.replace(hf_qwen3.model_config_from_hf(tiny_qwen3(moe=True).config.to_dict()), **{flag: value})
    with pytest.raises(ValueError, match=message) as error:
        hf_qwen3.hf_config(model, VOCAB)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("override,message", [
    ({"use_sliding_window": True, "sliding_window": 8}, "use_sliding_window"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"model_type": "qwen2"}, "model_type 'qwen2' is not one of"),
])
def test_hf_configs_we_cannot_hold_are_refused_in_one_line(override, message):
    with pytest.raises(ValueError, match=message) as error:
        hf_qwen3.model_config_from_hf(dict(tiny_qwen3().config.to_dict(), **override))
    assert "\n" not in str(error.value)


def test_convert_hf_picks_the_qwen3_converter():
    model = hf_qwen3.model_config_from_hf(tiny_qwen3(moe=True).config.to_dict())
    assert convert_hf.hf_family(model) is hf_qwen3
    assert convert_hf.hf_family(dataclasses.replace(model, num_experts=None)) is hf_qwen3
    assert convert_hf.hf_family(dataclasses.replace(model, qk_layernorm=False)).__name__.endswith("hf_mixtral")
