"""Hugging Face DeepSeek-V3 <-> our checkpoints (megatron_like/inference/hf_deepseek_v3.py and tools/convert_hf.py), on
a tiny random ``DeepseekV3ForCausalLM`` built from a config (nothing downloaded).

The tiny model has DeepSeek-V3's shape in small: MLA with a query latent and YaRN, RoPE on interleaved pairs
(``rope_interleave``, so the rope rows must be reordered), a first dense layer then an MoE layer of 8 experts in 4
groups (top-2 of the best 2 groups, sigmoid, scaling factor 2.5, one shared expert) with a random
``e_score_correction_bias`` (our expert bias), and every norm weight drawn around 1. from-hf writes tp1 and
tp2 x pp2 checkpoints whose logits, read back in one process, equal transformers'; greedy generation through our
latent KV cache gives transformers' tokens; to-hf gives back the same tensors bit for bit. An MTP depth (an MoE layer,
as DeepSeek-V3's) goes to DeepSeek's published layer ``num_hidden_layers`` and back unchanged, and computes what
DeepSeek's MTP module built from transformers' own layer computes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
import transformers  # a test dependency: missing, these tests fail
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_modeling

from megatron_like.inference import hf_deepseek_v3, hf_gpt2, load_inference_model
from megatron_like.model import GPTModel
from megatron_like.parallel_state import ParallelState
from tests.unit.test_hf_llama import IDS, LOGIT_ATOL, VOCAB, assert_greedy_equals_hf, convert_hf, converted_layouts

H, HEADS, Q_RANK, KV_RANK, NOPE, ROPE, V, FFN, EXPERT_FFN, EXPERTS, LAYERS = 64, 4, 24, 16, 8, 8, 12, 96, 32, 8, 2
YARN = {"rope_type": "yarn", "rope_theta": 100.0, "factor": 8.0, "original_max_position_embeddings": 16,
        "beta_fast": 4.0, "beta_slow": 0.5, "mscale": 1.0, "mscale_all_dim": 0.5}


def tiny_deepseek(**overrides) -> transformers.DeepseekV3ForCausalLM:
    """A tiny random DeepseekV3ForCausalLM (layer 0 dense, layer 1 MoE), large init so attention, routing and every
    expert matter, norms around 1 and a random expert bias (HF initializes them to 1 and 0)."""
    values = dict(hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=HEADS, q_lora_rank=Q_RANK,
                  kv_lora_rank=KV_RANK, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V,
                  intermediate_size=FFN, moe_intermediate_size=EXPERT_FFN, n_routed_experts=EXPERTS,
                  num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5,
                  first_k_dense_replace=1, num_hidden_layers=LAYERS, vocab_size=VOCAB, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, max_position_embeddings=64, initializer_range=0.3,
                  rope_parameters=dict(YARN), num_mtp_layers=0)
    values.update(overrides)
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**values)).eval()
    with torch.no_grad():
        for name, param in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                param.normal_(0.0, 0.2)
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.3)
    return model


def ours_from(hf, directory) -> GPTModel:
    """Our one-process model holding ``hf``'s weights, through hf_deepseek_v3's config and state mapping."""
    hf.save_pretrained(directory)
    cfg, state = hf_gpt2.read_hf_dir(str(directory))
    config = hf_deepseek_v3.model_config_from_hf(cfg, state.keys())
    config.validate()
    model = GPTModel(config, ParallelState.single_process(torch.device("cpu")), vocab_size=VOCAB, seed=1)
    model.load_state_dict(hf_deepseek_v3.from_hf_state(state, config, VOCAB, cfg.get("rope_interleave", True)))
    return model.eval()


@pytest.fixture(scope="module")
def deepseek_dirs(tmp_path_factory):
    """(HF model, {"hf", "tp1", "tp2pp2", "back": directory}) converted by convert_hf.py."""
    hf = tiny_deepseek()
    return hf, converted_layouts(hf, tmp_path_factory.mktemp("deepseek_v3"))


@pytest.mark.parametrize("layout", ["tp1", "tp2pp2"])
def test_from_hf_keeps_the_logits(deepseek_dirs, layout):
    hf, dirs = deepseek_dirs
    loaded = load_inference_model(dirs[layout], ParallelState.single_process(torch.device("cpu")))
    m = loaded.config.model
    assert (m.multi_latent_attention, m.q_lora_rank, m.kv_lora_rank, m.qk_head_dim, m.qk_pos_emb_head_dim,
            m.v_head_dim, m.rope_type, m.mscale_all_dim) == (True, Q_RANK, KV_RANK, NOPE, ROPE, V, "yarn", 0.5)
    assert (m.num_experts, m.moe_layer_pattern, m.moe_router_score_function, m.moe_router_num_groups,
            m.moe_router_group_topk, m.moe_router_topk_scaling_factor, m.moe_shared_expert_intermediate_size,
            m.moe_router_enable_expert_bias, m.mtp_num_layers) == (
        EXPERTS, [False, True], "sigmoid", 4, 2, 2.5, EXPERT_FFN, True, None)
    with torch.no_grad():
        torch.testing.assert_close(loaded.model[0](IDS, None)[..., :VOCAB], hf(IDS).logits, rtol=1e-5,
                                   atol=LOGIT_ATOL)


def test_to_hf_round_trip_gives_the_same_tensors_and_logits(deepseek_dirs):
    hf, dirs = deepseek_dirs
    _, original = hf_gpt2.read_hf_dir(dirs["hf"])
    config, converted = hf_gpt2.read_hf_dir(dirs["back"])
    assert config["architectures"] == [hf_deepseek_v3.ARCHITECTURE] and config["first_k_dense_replace"] == 1
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in converted
    assert sorted(converted) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(converted[name], tensor), name
    back = transformers.AutoModelForCausalLM.from_pretrained(dirs["back"]).eval()
    assert type(back) is type(hf) and back.config.rope_interleave
    with torch.no_grad():
        torch.testing.assert_close(back(IDS).logits, hf(IDS).logits, rtol=0, atol=0)


@pytest.mark.parametrize("rope_interleave", [True, False])
def test_greedy_generation_through_the_latent_cache_equals_transformers(rope_interleave, tmp_path):
    """Left-padded prompts of 9 and 3 tokens, 12 new tokens each, through our compressed-latent cache (absorbed
    decode); with ``rope_interleave`` false the rope rows are taken as they are."""
    hf = tiny_deepseek(rope_interleave=rope_interleave)
    ours = ours_from(hf, tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(ours(IDS, None), hf(IDS).logits, rtol=1e-5, atol=LOGIT_ATOL)
    assert_greedy_equals_hf(ours, hf)


# ---------------------------------------------------------------- multi-token prediction
def mtp_model(hf, directory) -> GPTModel:
    """``hf``'s weights in our model with one MTP depth (an MoE layer) of random weights, norms around 1."""
    base = ours_from(hf, directory)
    config = dataclasses.replace(base.config, mtp_num_layers=1)
    model = GPTModel(config, base.ps, vocab_size=VOCAB, seed=2)
    model.load_state_dict(base.state_dict(), strict=False)
    with torch.no_grad():
        for name, param in model.mtp.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.3)
            else:
                param.normal_(0.0, 0.3)
        for name, buffer in model.mtp.named_buffers():
            if name.endswith("expert_bias"):
                buffer.normal_(0.0, 0.2)
    return model.eval()


def test_an_mtp_depth_converts_to_deepseeks_published_layer_and_back(tmp_path):
    ours = mtp_model(tiny_deepseek(), tmp_path)
    full = ours.state_dict()
    state = hf_deepseek_v3.to_hf_state(full, ours.config, VOCAB)
    config = hf_deepseek_v3.hf_config(ours.config, VOCAB)
    assert config["num_nextn_predict_layers"] == 1
    depth = {k for k in state if k.startswith(f"model.layers.{LAYERS}.")}
    assert {f"model.layers.{LAYERS}.{name}" for name in (
        "enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "shared_head.head.weight",
        "embed_tokens.weight", "mlp.gate.e_score_correction_bias", "mlp.experts.7.down_proj.weight",
        "mlp.shared_experts.up_proj.weight", "self_attn.kv_a_proj_with_mqa.weight")} <= depth
    read_back = hf_deepseek_v3.model_config_from_hf(config, state.keys())
    assert read_back.mtp_num_layers == 1
    back = hf_deepseek_v3.from_hf_state(state, read_back, VOCAB)
    assert sorted(back) == sorted(full)
    for name, tensor in full.items():
        assert torch.equal(back[name], tensor), name


def fused_experts(layer: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A decoder layer's published per-expert tensors -> transformers' in-memory ``experts.gate_up_proj [E, 2f, h]``
    (gate rows, then up rows) and ``experts.down_proj [E, h, f]``."""
    out = {k: v for k, v in layer.items() if not k.startswith("mlp.experts.")}
    out["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([layer[f"mlp.experts.{e}.gate_proj.weight"],
                                                              layer[f"mlp.experts.{e}.up_proj.weight"]])
                                                   for e in range(EXPERTS)])
    out["mlp.experts.down_proj"] = torch.stack([layer[f"mlp.experts.{e}.down_proj.weight"] for e in range(EXPERTS)])
    return out


def deepseek_mtp_logits(hf, hf_state: dict, ids: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's MTP module (its paper's §2.2 and its inference code's ``MTPLayer``) built from transformers'
    own decoder layer and norms, loaded from the HF layout, on top of the main model ``hf``: depth 1's logits
    ``[b, s - 1, v]`` (position t predicts token t + 2 from the main model's final hidden state at t and token
    t + 1's embedding)."""
    config = hf.config
    prefix = f"model.layers.{LAYERS}."
    mtp = {k[len(prefix):]: v for k, v in hf_state.items() if k.startswith(prefix)}
    layer = hf_modeling.DeepseekV3DecoderLayer(config, layer_idx=LAYERS).eval()
    layer.load_state_dict(fused_experts({k: v for k, v in mtp.items() if k.startswith((
        "self_attn.", "mlp.", "input_layernorm.", "post_attention_layernorm."))}))
    norms = {}
    for name in ("enorm", "hnorm", "shared_head.norm"):
        norms[name] = hf_modeling.DeepseekV3RMSNorm(H, eps=config.rms_norm_eps)
        norms[name].weight.data.copy_(mtp[name + ".weight"])
    with torch.no_grad():
        main = hf.model(ids).last_hidden_state[:, :-1]  # h^0 at t, after the final norm
        embedded = F.embedding(ids[:, 1:], mtp["embed_tokens.weight"])  # token t + 1
        x = F.linear(torch.cat([norms["enorm"](embedded), norms["hnorm"](main)], dim=-1), mtp["eh_proj.weight"])
        positions = torch.arange(x.shape[1])[None]
        mask = torch.full((x.shape[1], x.shape[1]), float("-inf")).triu(1)[None, None]
        x = layer(x, attention_mask=mask, position_ids=positions,
                  position_embeddings=hf.model.rotary_emb(x, positions))
        return F.linear(norms["shared_head.norm"](x), mtp["shared_head.head.weight"])


def test_the_converted_mtp_depth_computes_what_deepseeks_mtp_module_computes(tmp_path):
    """Our depth-1 loss at each position equals the cross entropy of DeepSeek's MTP module on the converted weights."""
    hf = tiny_deepseek()
    ours = mtp_model(hf, tmp_path)
    state = hf_deepseek_v3.to_hf_state(ours.state_dict(), ours.config, VOCAB)
    logits = deepseek_mtp_logits(hf, state, IDS)
    labels = torch.cat([IDS[:, 1:], IDS[:, :1]], dim=1)  # any token after the last: its MTP target is masked
    with torch.no_grad():
        per_token = ours(IDS, None, labels=labels, with_mtp=True)  # [1 + D, b, s]
    expected = F.cross_entropy(logits[:, :-1].transpose(1, 2), IDS[:, 2:], reduction="none")  # [b, s - 2]
    torch.testing.assert_close(per_token[1, :, :-2], expected, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- refusals and the family choice
@pytest.mark.parametrize("flag,value,message", [
    ("multi_latent_attention", False, "without --multi-latent-attention"),
    ("moe_layer_freq", "[1,0]", "dense layers first"),
    ("moe_router_score_function", "softmax", "--moe-router-score-function softmax"),
    ("moe_shared_expert_intermediate_size", None, "--moe-shared-expert-intermediate-size None"),
    ("moe_shared_expert_intermediate_size", 48, "a multiple of the experts' size 32"),
    ("moe_expert_capacity_factor", 1.0, "--moe-expert-capacity-factor"),
    ("qk_layernorm", True, "--qk-layernorm"),
])
def test_models_deepseek_v3_cannot_hold_are_refused_in_one_line(flag, value, message):
    model = dataclasses.replace(hf_deepseek_v3.model_config_from_hf(tiny_deepseek().config.to_dict()),
                                **{flag: value})
    with pytest.raises(ValueError, match=message) as error:
        hf_deepseek_v3.hf_config(model, VOCAB)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("override,message", [
    ({"n_shared_experts": 0}, "n_shared_experts 0"),
    ({"norm_topk_prob": False}, "norm_topk_prob=False"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 100.0, "factor": 2.0}}, "rope type 'linear'"),
    ({"attention_bias": True}, "attention_bias=True"),
])
def test_hf_configs_we_cannot_hold_are_refused_in_one_line(override, message):
    with pytest.raises(ValueError, match=message) as error:
        hf_deepseek_v3.model_config_from_hf(dict(tiny_deepseek().config.to_dict(), **override))
    assert "\n" not in str(error.value)


def test_an_fp8_checkpoint_is_refused_in_one_line():
    """DeepSeek publishes V3's weights as FP8 blocks with ``weight_scale_inv`` tensors beside them."""
    hf = tiny_deepseek()
    state = dict(hf.state_dict())
    state["model.layers.0.self_attn.q_a_proj.weight_scale_inv"] = torch.ones(1, 1)
    config = hf_deepseek_v3.model_config_from_hf(hf.config.to_dict())
    with pytest.raises(ValueError, match="q_a_proj.weight_scale_inv: an FP8 block-quantized checkpoint") as error:
        hf_deepseek_v3.from_hf_state(state, config, VOCAB)
    assert "\n" not in str(error.value)


def test_convert_hf_picks_the_deepseek_converter():
    model = hf_deepseek_v3.model_config_from_hf(tiny_deepseek().config.to_dict())
    assert convert_hf.hf_family(model) is hf_deepseek_v3
    assert convert_hf.hf_family(dataclasses.replace(model, num_experts=None)) is hf_deepseek_v3
