"""Hugging Face Llama / Mistral / Qwen2 <-> our checkpoints (megatron_like/inference/hf_llama.py and
tools/convert_hf.py), on tiny random transformers models built from a config (nothing downloaded).

from-hf writes a torch_dist checkpoint (padded for tp2 x pp2) whose logits (read back in one process) equal the
transformers model's; to-hf of that checkpoint loads in transformers with the same tensors; Qwen2's QKV
bias and Mistral's config convert the same way; each converter refuses the other family in one line. Llama 3.1's
and linear RoPE scaling and Mistral's sliding window (shorter than the sequence) give transformers' logits and
greedy generations (the KV cache past the window) after conversion, and convert back.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch
import transformers  # a test dependency: missing, these tests fail

from megatron_like.inference import GenerationParams, generate, hf_gpt2, hf_llama, load_inference_model
from megatron_like.model import GPTModel
from megatron_like.parallel_state import ParallelState

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import convert_hf  # noqa: E402

sys.path.pop(0)

H, HEADS, GROUPS, FFN, LAYERS, VOCAB = 64, 4, 2, 96, 2, 120


# Logits up to ~10 from std-0.3 weights, summed in other orders than transformers': 1e-5 holds with AVX-512 and
# AVX2 kernels, PyTorch's unvectorized kernels (MEGATRON_LIKE_ISA=scalar) reach 3e-5; a mapping error moves ~1.
LOGIT_ATOL = 5e-5

def converted_layouts(hf, root) -> dict[str, str]:
    """``hf`` saved under ``root``, converted by convert_hf.py to our tp1 and tp2 x pp2 checkpoints, and the latter
    back to Hugging Face: ``{"hf", "tp1", "tp2pp2", "back": directory}``."""
    hf.save_pretrained(root / "hf")
    convert_hf.main(["from-hf", "--load", str(root / "hf"), "--save", str(root / "tp1")])
    convert_hf.main(["from-hf", "--load", str(root / "hf"), "--save", str(root / "tp2pp2"),
                     "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"])
    convert_hf.main(["to-hf", "--load", str(root / "tp2pp2"), "--save", str(root / "back")])
    return {name: str(root / name) for name in ("hf", "tp1", "tp2pp2", "back")}


def assert_greedy_equals_hf(ours: GPTModel, hf) -> None:
    """12 greedy tokens of two prompts of different lengths through our KV cache equal transformers' generate."""
    prompts = [IDS[0, :9].tolist(), IDS[1, :3].tolist()]
    greedy = generate(ours, prompts, GenerationParams(max_new_tokens=12), vocab_size=VOCAB)
    for prompt, ours_greedy in zip(prompts, greedy):
        ids = torch.tensor([prompt])
        theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert ours_greedy[0].token_ids == theirs


def tiny(family: str, **overrides):
    """A tiny random ``<family>ForCausalLM`` (large init so attention and every layer matter)."""
    config_cls, model_cls = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
                             "mistral": ("MistralConfig", "MistralForCausalLM"),
                             "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}[family]
    values = dict(hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=GROUPS, intermediate_size=FFN,
                  num_hidden_layers=LAYERS, vocab_size=VOCAB, rope_theta=500000.0, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, max_position_embeddings=64, initializer_range=0.3)
    values.update(overrides)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**values)).eval()
    if family == "qwen2":  # HF initializes biases to zero: make them matter
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0.0, 0.3)
    return model


def ours_from(hf) -> GPTModel:
    """Our one-process model holding ``hf``'s weights (through hf_llama's config and state mapping)."""
    config = hf_llama.model_config_from_hf(hf.config.to_dict())
    config.validate()
    model = GPTModel(config, ParallelState.single_process(torch.device("cpu")), vocab_size=VOCAB, seed=1)
    model.load_state_dict(hf_llama.from_hf_state(hf.state_dict(), config, VOCAB))
    return model.eval()


IDS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def llama_dirs(tmp_path_factory):
    """(HF model, its directory, our tp2 x pp2 checkpoint converted from it, to-hf of that checkpoint)."""
    root = tmp_path_factory.mktemp("llama")
    hf = tiny("llama")
    hf.save_pretrained(root / "hf")
    convert_hf.main(["from-hf", "--load", str(root / "hf"), "--save", str(root / "ours"),
                     "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"])
    convert_hf.main(["to-hf", "--load", str(root / "ours"), "--save", str(root / "back")])
    return hf, str(root / "hf"), str(root / "ours"), str(root / "back")


def test_from_hf_at_tp2_pp2_keeps_the_logits(llama_dirs):
    hf, _, ours_dir, _ = llama_dirs
    # torch_dist (the default): global tensors, read here in one process
    assert sorted(os.listdir(os.path.join(ours_dir, "iter_0000000"))) == [".metadata", "__0_0.distcp", "common.pt"]
    loaded = load_inference_model(ours_dir, ParallelState.single_process(torch.device("cpu")))
    m = loaded.config.model
    assert (m.query_groups, m.rotary_base, m.swiglu, m.linear_bias, m.qkv_bias) == (GROUPS, 500000, True, False,
                                                                                   False)
    with torch.no_grad():
        torch.testing.assert_close(loaded.model[0](IDS, None)[..., :VOCAB], hf(IDS).logits, rtol=1e-5, atol=LOGIT_ATOL)


def test_to_hf_round_trip_gives_the_same_tensors_and_logits(llama_dirs):
    hf, _, _, back_dir = llama_dirs
    back = transformers.AutoModelForCausalLM.from_pretrained(back_dir).eval()
    assert type(back).__name__ == "LlamaForCausalLM" and back.config.num_key_value_heads == GROUPS
    assert back.config.vocab_size == VOCAB
    original, converted = hf.state_dict(), back.state_dict()
    assert sorted(converted) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(converted[name], tensor), name
    with torch.no_grad():
        torch.testing.assert_close(back(IDS).logits, hf(IDS).logits, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_qwen2_bias_and_mistral_convert_both_ways(family):
    hf = tiny(family, **({"sliding_window": 32} if family == "mistral" else {}))
    ours = ours_from(hf)
    assert ours.config.qkv_bias == (family == "qwen2") and not ours.config.linear_bias
    if family == "mistral":
        assert ours.config.attention_window == 32 and ours.config.window_size == "31,0"
    with torch.no_grad():
        torch.testing.assert_close(ours(IDS, None), hf(IDS).logits, rtol=1e-5, atol=LOGIT_ATOL)
    back = hf_llama.to_hf_state(ours.state_dict(), ours.config, VOCAB)
    assert sorted(back) == sorted(hf.state_dict())
    for name, tensor in hf.state_dict().items():
        assert torch.equal(back[name], tensor), name
    config = hf_llama.hf_config(ours.config, VOCAB)
    assert config["model_type"] == family
    rebuilt = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config)).eval()
    rebuilt.load_state_dict(back, strict=True)  # to-hf's config and tensors make a working HF model
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(IDS).logits, hf(IDS).logits, rtol=0, atol=0)


def test_each_converter_refuses_the_other_family():
    llama = hf_llama.model_config_from_hf(tiny("llama").config.to_dict())
    gpt2 = hf_gpt2.model_config_from_hf(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4).to_dict())
    with pytest.raises(ValueError, match="position_embedding_type='rope', not GPT-2's 'learned_absolute'"):
        hf_gpt2.hf_config(llama, VOCAB)
    with pytest.raises(ValueError, match="position_embedding_type='learned_absolute'; a Llama/Qwen2 model needs "
                                         "--position-embedding-type rope"):
        hf_llama.to_hf_state({}, gpt2, VOCAB)
    windowed = dataclasses.replace(gpt2, window_size="7,0")  # GPT-2 has no sliding window: not dropped silently
    with pytest.raises(ValueError, match="--window-size 7,0: GPT2LMHeadModel has no sliding window"):
        hf_gpt2.hf_config(windowed, VOCAB)
    with pytest.raises(ValueError, match="model_type 'llama' is not GPT-2"):
        hf_gpt2.model_config_from_hf(tiny("llama").config.to_dict())
    with pytest.raises(ValueError, match="model_type 'gpt2' is not one of"):
        hf_llama.model_config_from_hf(transformers.GPT2Config().to_dict())
    scaled = dict(tiny("llama").config.to_dict(), rope_parameters={"rope_type": "yarn", "rope_theta": 5e5})
    with pytest.raises(ValueError, match="rope type 'yarn' is not implemented"):
        hf_llama.model_config_from_hf(scaled)
    qwen_window = dict(tiny("qwen2").config.to_dict(), use_sliding_window=True, sliding_window=8)
    with pytest.raises(ValueError, match="Qwen2's use_sliding_window"):
        hf_llama.model_config_from_hf(qwen_window)


# The scalings stretch a pretraining context of 16 positions (tiny's 64-position model reads 24-token inputs):
# with head dim 16 and rope_theta 5e5 the rotary wavelengths are 6.3, 32, 167, ... positions, so llama3 keeps
# one frequency, interpolates one and divides the other six; linear divides them all.
LONG_CONTEXT = {
    "llama3": ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}),
    "linear": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    "window": ("mistral", {"sliding_window": 5}),  # 5 keys per query: shorter than every input below
}


@pytest.mark.parametrize("variant", list(LONG_CONTEXT))
def test_rope_scaling_and_sliding_window_equal_transformers(variant, monkeypatch):
    """Logits over 24 tokens (the window through the blockwise core, and through the dense band that compiled code
    takes: SDPA and the local core with and without the fused softmax), greedy generation of left-padded prompts
    through the KV cache well past the window, and to-hf's config."""
    family, overrides = LONG_CONTEXT[variant]
    hf = tiny(family, **overrides)
    ours = ours_from(hf)
    m = ours.config
    assert {"llama3": m.use_rope_scaling and m.rope_scaling_original_max_position_embeddings == 16,
            "linear": m.rotary_seq_len_interpolation_factor == 4.0, "window": m.attention_window == 5}[variant]
    with torch.no_grad():
        expected = hf(IDS).logits
        torch.testing.assert_close(ours(IDS, None), expected, rtol=1e-5, atol=LOGIT_ATOL)
        if variant == "window":
            with monkeypatch.context() as patch:  # the dense band of torch.compile / torch.export
                patch.setattr(type(ours.layers[0].attention), "skips_masked_blocks", lambda *args: False)
                torch.testing.assert_close(ours(IDS, None), expected, rtol=1e-5, atol=LOGIT_ATOL)
                for fusion in (True, False):
                    for layer in ours.layers:
                        layer.attention.backend, layer.attention.softmax_fusion = "local", fusion
                    torch.testing.assert_close(ours(IDS, None), expected, rtol=1e-5, atol=LOGIT_ATOL)
            for layer in ours.layers:
                layer.attention.backend, layer.attention.softmax_fusion = "sdpa", True
    assert_greedy_equals_hf(ours, hf)
    config = hf_llama.hf_config(m, VOCAB)
    assert config["model_type"] == family
    rebuilt = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config)).eval()
    rebuilt.load_state_dict(hf_llama.to_hf_state(ours.state_dict(), m, VOCAB), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(IDS).logits, expected, rtol=0, atol=0)
