"""The Llama-family architecture flags on one process: the model equals Hugging Face's LlamaForCausalLM.

Our weights map onto transformers' by layout alone (QKV grouped per key/value head, fc1 as (gate, up)
pairs; the mapping is megatron_like/inference/hf_llama.py's), so equal logits prove rotary positions, RMSNorm,
SwiGLU and grouped-query attention mean what Llama means. Generation with the KV cache (rotary offsets, a cache sized
by query groups) must equal the full forward.
"""

from __future__ import annotations

import pytest
import torch

from megatron_like.config import ConfigError, ModelConfig, parse_config
from megatron_like.inference import hf_llama
from megatron_like.model import GPTModel
from megatron_like.parallel_state import ParallelState

H, HEADS, GROUPS, FFN, LAYERS, VOCAB = 64, 4, 2, 96, 2, 128


def llama_config(**overrides) -> ModelConfig:
    values = dict(num_layers=LAYERS, hidden_size=H, num_attention_heads=HEADS, seq_length=16,
                  position_embedding_type="rope", rotary_base=500000, normalization="RMSNorm", swiglu=True,
                  group_query_attention=True, num_query_groups=GROUPS, disable_bias_linear=True,
                  ffn_hidden_size=FFN, untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
                  attention_dropout=0.0)
    values.update(overrides)
    config = ModelConfig(**values)
    config.validate()
    return config


@pytest.fixture(scope="module")
def hf_and_ours():
    import transformers  # a test dependency: missing, this fails
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=GROUPS, intermediate_size=FFN,
        num_hidden_layers=LAYERS, vocab_size=VOCAB, rope_theta=500000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=False, max_position_embeddings=64, initializer_range=0.3)).eval()  # attention matters
    ours = GPTModel(llama_config(), ParallelState.single_process(torch.device("cpu")), vocab_size=VOCAB, seed=1)
    ours.load_state_dict(hf_llama.from_hf_state(hf.state_dict(), ours.config, VOCAB))
    return hf, ours.eval()


@pytest.mark.parametrize("backend", ["sdpa", "unfused"])
def test_llama_logits_equal_transformers(hf_and_ours, backend):
    hf, ours = hf_and_ours
    ours.layers[0].attention.backend = ours.layers[1].attention.backend = ModelConfig(
        attention_backend=backend).attention_core
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf(ids).logits
        logits = ours(ids, None)
    # Logits up to ~9 from std-0.3 weights: with PyTorch's AVX2 kernels (ATEN_CPU_CAPABILITY=avx2, or a CPU
    # without AVX-512) the SDPA path's sums round differently, 1.1e-5 at worst; a mapping error moves logits by ~1.
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=3e-5)


def test_kv_cache_decoding_equals_full_forward(hf_and_ours):
    """Prefill 5 tokens, then decode one at a time: rotary positions continue after the cache."""
    from megatron_like.inference.kv_cache import KVCache

    _, ours = hf_and_ours
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(4))
    cache = KVCache(batch_size=2, max_length=9)
    with torch.no_grad():
        full = ours(ids, None)
        steps = [ours(ids[:, :5], None, inference_context=cache)]
        cache.advance(5)
        for t in range(5, 9):
            steps.append(ours(ids[:, t:t + 1], None, inference_context=cache))
            cache.advance(1)
    assert cache.keys[0].shape[1] == GROUPS  # the cache holds one key head per query group
    # Logits up to ~9 from std-0.3 weights: the cached (SDPA) and full paths sum in other orders, and
    # one-ulp changes anywhere (e.g. the fused kernels) move the worst element by ~1e-5; wrong positions
    # would move logits by ~1.
    torch.testing.assert_close(torch.cat(steps, dim=1), full[:, 4:], rtol=5e-5, atol=5e-5)


def test_greedy_and_beam_search_equal_transformers_generate(hf_and_ours):
    """Left-padded batches with the KV cache: greedy equals HF greedy per prompt; beam search equals HF's."""
    from megatron_like.inference import GenerationParams, generate

    hf, ours = hf_and_ours
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8], [9, 10, 11]]
    greedy = generate(ours, prompts, GenerationParams(max_new_tokens=10), vocab_size=VOCAB)
    uncached = generate(ours, prompts, GenerationParams(max_new_tokens=10, use_cache=False), vocab_size=VOCAB)
    beams = generate(ours, prompts[:1], GenerationParams(max_new_tokens=6, num_beams=3, num_return_sequences=2),
                     vocab_size=VOCAB)[0]
    for prompt, ours_greedy, ours_uncached in zip(prompts, greedy, uncached):
        ids = torch.tensor([prompt])
        theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert ours_greedy[0].token_ids == ours_uncached[0].token_ids == theirs
    ids = torch.tensor([prompts[0]])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, num_beams=3, num_return_sequences=2,
                      do_sample=False, eos_token_id=None, pad_token_id=0, length_penalty=1.0)
    assert [g.token_ids for g in beams] == out[:, len(prompts[0]):].tolist()


def test_partial_rotary_leaves_the_other_dimensions_alone():
    from megatron_like.model.rotary import apply_rotary, rotary_cos_sin

    x = torch.randn(1, 2, 5, 16)
    cos, sin = rotary_cos_sin(torch.arange(5), rotary_dim=8, base=10000)
    y = apply_rotary(x, cos, sin)
    assert torch.equal(y[..., 8:], x[..., 8:]) and not torch.allclose(y[..., :8], x[..., :8])
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))  # a rotation keeps lengths
    torch.testing.assert_close(y[:, :, 0], x[:, :, 0])  # position 0 is not rotated


LLAMA_FLAGS = ["--position-embedding-type", "rope", "--rotary-base", "500000", "--normalization", "RMSNorm",
               "--norm-epsilon", "1e-6", "--swiglu", "--group-query-attention", "--num-query-groups", "2",
               "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--mock-data", "--vocab-size", "64"]


def test_megatron_llama_flags_parse():
    m = parse_config(LLAMA_FLAGS).model
    assert (m.position_embedding_type, m.rotary_base, m.normalization, m.norm_epsilon) == ("rope", 500000,
                                                                                            "RMSNorm", 1e-6)
    assert m.swiglu and m.query_groups == 2 and not m.linear_bias and not m.qkv_bias
    assert m.ffn_size == int((4 * 64 * 2 / 3) / 64) * 64  # Megatron's SwiGLU default
    legacy = parse_config(["--use-rotary-position-embeddings", "--layernorm-epsilon", "1e-6", "--mock-data",
                           "--vocab-size", "64"]).model
    assert legacy.position_embedding_type == "rope" and legacy.norm_epsilon == 1e-6
    for megatron, ours in [("flash", "sdpa"), ("fused", "sdpa"), ("auto", "sdpa"), ("unfused", "local"),
                           ("local", "local")]:
        assert parse_config(["--attention-backend", megatron, "--mock-data", "--vocab-size", "64"]
                            ).model.attention_core == ours
    qwen = parse_config(LLAMA_FLAGS + ["--add-qkv-bias"]).model
    assert qwen.qkv_bias and not qwen.linear_bias
    llama31 = parse_config(LLAMA_FLAGS + ["--use-rope-scaling", "--rope-scaling-factor", "32"]).model
    assert llama31.use_rope_scaling and llama31.rope_scaling_factor == 32.0
    assert (llama31.rope_scaling_low_freq_factor, llama31.rope_scaling_high_freq_factor,
            llama31.rope_scaling_original_max_position_embeddings) == (1.0, 4.0, 8192)  # Megatron-LM's fixed values
    linear = parse_config(LLAMA_FLAGS + ["--rotary-seq-len-interpolation-factor", "4"]).model
    assert linear.rotary_seq_len_interpolation_factor == 4.0 and not linear.use_rope_scaling
    mistral = parse_config(LLAMA_FLAGS + ["--window-size", "4095,0"]).model
    assert mistral.attention_window == 4096  # Mistral's sliding_window: the query itself and 4095 keys before it
    assert parse_config(LLAMA_FLAGS + ["--window-size", "(-1,0)"]).model.attention_window is None  # -1: infinite


@pytest.mark.parametrize("flags, message", [
    (["--num-query-groups", "3"], "--num-attention-heads 4 is not divisible by --num-query-groups 3"),
    (["--num-query-groups", "2", "--tensor-model-parallel-size", "4"],
     "--num-query-groups 2 is not divisible by --tensor-model-parallel-size 4"),
    (["--rotary-percent", "0"], "--rotary-percent 0.0 must be in (0, 1]"),
    (["--rotary-percent", "1.5"], "--rotary-percent 1.5 must be in (0, 1]"),
    (["--window-size", "4096"], "--window-size '4096' must be two integers LEFT,RIGHT such as 4095,0"),
    (["--window-size", "4095,4095"], "--window-size 4095,4095: RIGHT must be 0"),
    (["--window-size=-2,0"], "--window-size -2,0: LEFT must be -1 (no window) or at least 0"),
    (["--use-rope-scaling"], "--use-rope-scaling needs --position-embedding-type rope"),
    (["--position-embedding-type", "rope", "--use-rope-scaling", "--rotary-seq-len-interpolation-factor", "2"],
     "--use-rope-scaling and --rotary-seq-len-interpolation-factor are two RoPE scalings: pick one"),
    (["--position-embedding-type", "rope", "--rotary-seq-len-interpolation-factor", "0"],
     "--rotary-seq-len-interpolation-factor 0.0 must be positive"),
    (["--position-embedding-type", "rope", "--use-rope-scaling", "--rope-scaling-low-freq-factor", "4"],
     "--rope-scaling-low-freq-factor 4.0 must be below --rope-scaling-high-freq-factor 4.0"),
])
def test_bad_architecture_flags_are_one_line_errors(flags, message):
    base = ["--group-query-attention", "--num-attention-heads", "4", "--mock-data", "--vocab-size", "64"]
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_config(base + flags, world_size=4)


def test_other_bad_combinations():
    with pytest.raises(ConfigError, match="needs --group-query-attention"):
        parse_config(["--num-query-groups", "2", "--mock-data", "--vocab-size", "64"])
    with pytest.raises(ConfigError, match="--add-qkv-bias needs --disable-bias-linear"):
        parse_config(["--add-qkv-bias", "--mock-data", "--vocab-size", "64"])


def export_checkpoint_of(ours: GPTModel, model: ModelConfig, root: str):
    """(tools/export.py's torch.export program, its loaded InferenceModel) of ``ours`` saved under ``root`` with
    the config ``model`` (mock data)."""
    import os
    import sys

    from megatron_like.config import Config
    from megatron_like.model.state import gather_full_state
    from tests.unit.test_generation_state import write_checkpoint

    config = Config(model=model)
    config.data.mock_data = True
    write_checkpoint(root, config, gather_full_state([ours]), VOCAB)
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
    try:
        import export
    finally:
        sys.path.pop(0)
    return export.export_program(root)


def test_export_and_evaluation_forward_of_a_llama_checkpoint(hf_and_ours, tmp_path):
    """tools/export.py's torch.export program and the evaluation loop on a saved Llama-style checkpoint."""
    from megatron_like.inference.evaluation import pipelined_forward

    _, ours = hf_and_ours
    model = llama_config(vocab_size=VOCAB, make_vocab_size_divisible_by=8, seq_length=32)
    program, loaded = export_checkpoint_of(ours, model, str(tmp_path))
    ids = torch.randint(0, VOCAB, (3, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = ours(ids, None)
        torch.testing.assert_close(program.module()(ids), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pipelined_forward(loaded.model[0], ids)[..., :VOCAB], expected, rtol=1e-5,
                                   atol=1e-5)


def test_export_of_a_sliding_window_and_rope_scaling_checkpoint(tmp_path):
    """torch.export's dynamic sequence length holds a model with a window: the band is traced at any length (a
    branch on ``window >= s`` would pin ``seq`` and refuse the export), and lengths on both sides of the window
    give the model's logits."""
    model = llama_config(vocab_size=VOCAB, make_vocab_size_divisible_by=8, seq_length=32, window_size="5,0",
                         use_rope_scaling=True, rope_scaling_original_max_position_embeddings=8)
    ours = GPTModel(model, ParallelState.single_process(torch.device("cpu")), vocab_size=VOCAB, seed=1).eval()
    program, _ = export_checkpoint_of(ours, model, str(tmp_path))
    for length in (4, 20):  # within the window of 6 keys, and past it
        ids = torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            torch.testing.assert_close(program.module()(ids), ours(ids, None), rtol=1e-5, atol=1e-5)


def test_resuming_with_other_architecture_flags_is_refused_and_old_checkpoints_still_load():
    from megatron_like.training.checkpointing import CheckpointError, check_compatible

    saved = parse_config(LLAMA_FLAGS)
    gpt = parse_config(["--mock-data", "--vocab-size", "64", "--untie-embeddings-and-output-weights",
                        "--norm-epsilon", "1e-6"])
    with pytest.raises(CheckpointError, match="has --position-embedding-type rope but this run has learned_absolute"):
        check_compatible({"config": saved.to_dict()}, gpt, "ckpt")
    check_compatible({"config": saved.to_dict()}, parse_config(LLAMA_FLAGS), "ckpt")
    older = gpt.to_dict()  # a checkpoint written before these flags existed (and with the old epsilon name)
    for name in ("position_embedding_type", "normalization", "swiglu", "group_query_attention", "num_query_groups",
                 "disable_bias_linear", "add_qkv_bias"):
        del older["model"][name]
    older["model"]["layernorm_epsilon"] = older["model"].pop("norm_epsilon")
    check_compatible({"config": older}, gpt, "ckpt")
    from megatron_like.config import Config

    older["model"]["layernorm_epsilon"] = 1e-6
    assert Config.from_dict(older).model.norm_epsilon == 1e-6


def test_no_position_embeddings_at_all():
    config = llama_config(position_embedding_type="none")
    model = GPTModel(config, ParallelState.single_process(torch.device("cpu")), vocab_size=VOCAB, seed=1)
    assert not any("position" in name for name, _ in model.named_parameters())
    assert not model.layers[0].attention.rotary
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(6))
    loss = model(ids, None, labels=ids).mean()
    loss.backward()
    assert torch.isfinite(loss) and model.layers[0].attention.qkv.weight.grad.abs().sum() > 0


def test_decode_steps_run_the_fast_path(hf_and_ours, monkeypatch):
    """What makes generation fast, checked without a clock: after the prefill each decode step feeds one
    position, into a cache preallocated once and written in place, returns the last position's logits only,
    runs under inference mode through the prepacked linears (oneDNN for several rows), and rotary tables are
    built once per generation. Packed tokens equal the unpacked ones."""
    from megatron_like.inference import GenerationParams, generate, kv_cache, packed_linear
    from megatron_like.model import transformer

    _, ours = hf_and_ours
    if not packed_linear.available():
        pytest.skip("this torch build has neither oneDNN nor MKL packed GEMM")
    prompts, new = [[1, 2, 3, 4, 5, 6], [7, 8], [9, 10, 11]], 6
    expected = generate(ours, prompts, GenerationParams(max_new_tokens=new), vocab_size=VOCAB)
    seen, calls = [], {"packed": 0, "tables": 0}

    def record(module, args, kwargs, output):
        cache = kwargs["inference_context"]
        seen.append((args[0].shape[1], tuple(output.shape), cache.keys[0].data_ptr(), tuple(cache.keys[0].shape),
                     torch.is_inference_mode_enabled()))

    def counting(original, key):
        def wrapper(*args, **kwargs):
            calls[key] += 1
            return original(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(packed_linear, "_packed_matmul", counting(packed_linear._packed_matmul, "packed"))
    monkeypatch.setattr(kv_cache, "rotary_cos_sin", counting(kv_cache.rotary_cos_sin, "tables"))
    def training_tables(*args):
        raise AssertionError("a decode step recomputed rotary tables instead of slicing the cache's")

    monkeypatch.setattr(transformer, "sequence_rotary_tables", training_tables)
    hook = ours.register_forward_hook(record, with_kwargs=True)
    try:
        packed_linear.ensure_packed([ours], len(prompts))
        assert ours.output_layer._packed_backend == ("onednn" if packed_linear._has_onednn() else "mkl")
        packed = generate(ours, prompts, GenerationParams(max_new_tokens=new), vocab_size=VOCAB)
    finally:
        hook.remove()
        packed_linear.unpack_linears([ours])
    assert [g[0].token_ids for g in packed] == [g[0].token_ids for g in expected]
    assert [fed for fed, *_ in seen] == [6] + [1] * (new - 1)  # the prefill, then one position per step
    assert {out for _, out, *_ in seen} == {(3, 1, VOCAB)}  # logits of the last position only
    assert len({ptr for _, _, ptr, *_ in seen}) == 1  # one buffer, written in place (no torch.cat)
    assert {shape for *_, shape, _ in seen} == {(3, GROUPS, 6 + new, H // HEADS)}  # sized once, by query groups
    assert all(inference for *_, inference in seen)
    assert calls == {"packed": new * (4 * LAYERS + 1), "tables": 1}  # every linear of every forward was packed
    if packed_linear._has_mkl():
        assert packed_linear.backend(1) == "mkl"  # one row: MKL's packed GEMV-like path is the faster one


def test_training_builds_rotary_tables_once_and_they_survive_inference_mode(monkeypatch):
    """Every layer of every step reuses one pair of tables (built under inference_mode by evaluation first:
    still usable by a training backward), and a model with other rotary settings gets its own."""
    from megatron_like.model import rotary

    built = []

    def counting(positions, rotary_dim, base, scaling=None):
        built.append((len(positions), rotary_dim, base) + ((scaling.kind,) if scaling else ()))
        return original(positions, rotary_dim, base, scaling)

    original = rotary.rotary_cos_sin
    monkeypatch.setattr(rotary, "rotary_cos_sin", counting)
    rotary._cached_tables.cache_clear()
    ours = GPTModel(llama_config(), ParallelState.single_process(torch.device("cpu")), vocab_size=VOCAB, seed=1)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        ours(ids[:, :-1], None)
    for _ in range(2):
        ours(ids[:, :-1], None, labels=ids[:, 1:]).mean().backward()
    assert built == [(15, H // HEADS, 500000)]
    other = GPTModel(llama_config(rotary_base=10000), ParallelState.single_process(torch.device("cpu")),
                     vocab_size=VOCAB, seed=1)
    other(ids[:, :-1], None)
    assert built[1:] == [(15, H // HEADS, 10000)]
    scaled = GPTModel(llama_config(use_rope_scaling=True), ParallelState.single_process(torch.device("cpu")),
                      vocab_size=VOCAB, seed=1)
    scaled(ids[:, :-1], None)
    assert built[2:] == [(15, H // HEADS, 500000, "llama3")]  # RoPE scaling: tables of their own


def test_rope_scaling_numbers_without_use_rope_scaling_are_refused():
    """Llama 3.1's scaling numbers without --use-rope-scaling would change nothing: the flag they need is named."""
    with pytest.raises(ConfigError, match="--rope-scaling-factor 32.0 needs --use-rope-scaling"):
        parse_config(LLAMA_FLAGS + ["--rope-scaling-factor", "32"])
    assert parse_config(LLAMA_FLAGS + ["--use-rope-scaling", "--rope-scaling-factor", "32"]).model.use_rope_scaling


def test_vit_refuses_a_sliding_window():
    import pretrain_vit

    with pytest.raises(ConfigError, match="--window-size 3,0: ViT attention is bidirectional"):
        pretrain_vit.build_config(["--mock-data", "--window-size", "3,0"])
