"""Hugging Face Mixtral <-> our checkpoints (megatron_like/inference/hf_mixtral.py and tools/convert_hf.py), on a
tiny random ``MixtralForCausalLM`` built from a config (nothing downloaded).

from-hf writes tp1 and tp2 x pp2 checkpoints (expert parallelism 1) whose logits, read back in one process,
equal the transformers model's; to-hf of the tp2 x pp2 one gives back the published tensor names and values,
and transformers loads it with the same logits; layouts HF cannot hold are refused in one line.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers  # a test dependency: missing, these tests fail

from megatron_like.inference import hf_gpt2, hf_mixtral, load_inference_model
from megatron_like.parallel_state import ParallelState
from tests.unit.test_hf_llama import convert_hf, converted_layouts

H, HEADS, GROUPS, FFN, LAYERS, VOCAB, EXPERTS, TOPK = 64, 4, 2, 48, 2, 120, 4, 2
IDS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))


def tiny_mixtral():
    """A tiny random MixtralForCausalLM (large init so attention, routing and every expert matter; at 0.3 fp32
    rounding (transformers runs the experts with torch.grouped_mm) grows to 4e-5 on logits of 9)."""
    config = transformers.MixtralConfig(
        hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=GROUPS, intermediate_size=FFN,
        num_hidden_layers=LAYERS, vocab_size=VOCAB, num_local_experts=EXPERTS, num_experts_per_tok=TOPK,
        rope_theta=1000000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=64,
        initializer_range=0.2, router_aux_loss_coef=0.02)
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config).eval()


@pytest.fixture(scope="module")
def mixtral_dirs(tmp_path_factory):
    """(HF model, its directory, our tp1 and tp2 x pp2 checkpoints converted from it, to-hf of the latter)."""
    root = tmp_path_factory.mktemp("mixtral")
    hf = tiny_mixtral()
    return hf, converted_layouts(hf, root)


@pytest.mark.parametrize("layout", ["tp1", "tp2pp2"])
def test_from_hf_keeps_the_logits(mixtral_dirs, layout):
    hf, dirs = mixtral_dirs
    loaded = load_inference_model(dirs[layout], ParallelState.single_process(torch.device("cpu")))
    m = loaded.config.model
    assert (m.num_experts, m.moe_router_topk, m.moe_ffn_size, m.query_groups, m.rotary_base) == (
        EXPERTS, TOPK, FFN, GROUPS, 1000000)
    assert m.moe_aux_loss_coeff == 0.02
    with torch.no_grad():
        torch.testing.assert_close(loaded.model[0](IDS, None)[..., :VOCAB], hf(IDS).logits, rtol=1e-5, atol=1e-5)


def test_to_hf_round_trip_gives_the_published_tensors_and_logits(mixtral_dirs):
    hf, dirs = mixtral_dirs
    _, original = hf_gpt2.read_hf_dir(dirs["hf"])
    config, converted = hf_gpt2.read_hf_dir(dirs["back"])
    assert config["model_type"] == "mixtral" and config["architectures"] == ["MixtralForCausalLM"]
    assert "model.layers.1.block_sparse_moe.experts.3.w3.weight" in converted
    assert sorted(converted) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(converted[name], tensor), name
    back = transformers.AutoModelForCausalLM.from_pretrained(dirs["back"]).eval()
    assert type(back).__name__ == "MixtralForCausalLM" and back.config.num_local_experts == EXPERTS
    with torch.no_grad():
        torch.testing.assert_close(back(IDS).logits, hf(IDS).logits, rtol=0, atol=0)


@pytest.mark.parametrize("flag,value,message", [
    ("moe_shared_expert_intermediate_size", 16, "--moe-shared-expert-intermediate-size"),
    ("moe_layer_freq", "[1,0]", "--moe-layer-freq"),
    ("moe_expert_capacity_factor", 1.0, "--moe-expert-capacity-factor"),
    ("moe_router_pre_softmax", True, "--moe-router-pre-softmax"),
    ("num_experts", None, "converts to LlamaForCausalLM"),
])
def test_layouts_mixtral_cannot_hold_are_refused_in_one_line(flag, value, message):
    model = dataclasses.replace(hf_mixtral.model_config_from_hf(tiny_mixtral().config.to_dict()), **{flag: value})
    with pytest.raises(ValueError, match=message) as error:
        hf_mixtral.hf_config(model, VOCAB)
    assert "\n" not in str(error.value)


def test_convert_hf_picks_the_mixtral_converter():
    model = hf_mixtral.model_config_from_hf(tiny_mixtral().config.to_dict())
    assert convert_hf.hf_family(model) is hf_mixtral
    assert convert_hf.hf_family(dataclasses.replace(model, num_experts=None)).__name__.endswith("hf_llama")
