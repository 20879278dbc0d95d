"""Multi-latent attention on one process, in float64, against a straightforward implementation written here from
DeepSeek-V2/V3's equations (and, where the installed transformers has it, against its DeepseekV3Attention on the
same weights): outputs and every weight's gradient, with and without the query latent, with plain RoPE and with
YaRN (frequency blend, table factor mscale / mscale_all_dim, softmax factor mscale_all_dim^2). Then generation:
the compressed-latent cache with absorbed decode gives the same tokens as full keys and values and as no cache,
and holds ``kv_lora_rank + qk_pos_emb_head_dim`` values per token and layer.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from megatron_like.config import ModelConfig
from megatron_like.config.errors import ConfigError
from megatron_like.inference import GenerationParams, generate
from megatron_like.inference.kv_cache import KVCache
from megatron_like.model import GPTModel
from megatron_like.model.multi_latent_attention import MultiLatentAttention
from megatron_like.parallel_state import ParallelState

HEADS, NOPE, ROPE, V, KV_RANK, Q_RANK, HIDDEN, SEQ = 4, 6, 4, 5, 8, 12, 32, 10
MLA = ModelConfig(
    num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS, seq_length=SEQ, hidden_dropout=0.0,
    attention_dropout=0.0, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
    disable_bias_linear=True, multi_latent_attention=True, q_lora_rank=Q_RANK, kv_lora_rank=KV_RANK,
    qk_head_dim=NOPE, qk_pos_emb_head_dim=ROPE, v_head_dim=V, init_method_std=0.3,
)
# YaRN stretched so far that some frequencies are kept, some divided and some blended at this rope dimension.
YARN = dict(rope_type="yarn", rotary_scaling_factor=8.0, original_max_position_embeddings=64, beta_fast=4.0,
            beta_slow=0.5, mscale=1.0, mscale_all_dim=0.5, rotary_base=100)


# ------------------------------------------------------------------ the straightforward implementation
def yarn_mscale(factor: float, m: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def reference_tables(config: ModelConfig, s: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """cos, sin ``[s, ROPE]`` (float64) and the softmax scale, from DeepSeek-V3's YaRN equations."""
    d, base = config.qk_pos_emb_head_dim, float(config.rotary_base)
    extrapolated = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    scale = 1.0 / math.sqrt(config.qk_head_dim + d)
    table_factor = 1.0
    inv_freq = extrapolated
    if config.rope_type == "yarn":
        f, orig = config.rotary_scaling_factor, config.original_max_position_embeddings

        def correction_dim(rotations: float) -> float:
            return d * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(correction_dim(config.beta_fast)), 0)
        high = min(math.ceil(correction_dim(config.beta_slow)), d - 1)
        ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low), 0, 1)
        keep = 1 - ramp
        inv_freq = extrapolated / f * (1 - keep) + extrapolated * keep
        table_factor = yarn_mscale(f, config.mscale) / yarn_mscale(f, config.mscale_all_dim)
        scale *= yarn_mscale(f, config.mscale_all_dim) ** 2
    angles = torch.outer(torch.arange(s, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos() * table_factor, angles.sin() * table_factor, scale


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [b, s, ..., d]`` rotated by the half-split pairs (i, i + d / 2)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    shape = (1, x.shape[1]) + (1,) * (x.dim() - 3) + (x.shape[-1],)
    return x * cos.view(shape) + rotated * sin.view(shape)


def reference_attention(x: torch.Tensor, w: dict[str, torch.Tensor], config: ModelConfig) -> torch.Tensor:
    """MLA by its equations: ``x [b, s, h]`` -> ``[b, s, h]``; ``w``: weights under the module's names."""
    b, s, _ = x.shape
    eps = config.norm_epsilon
    if config.q_lora_rank is None:
        q = x @ w["q_proj.weight"].T
    else:
        q = rms(x @ w["q_down.weight"].T, w["q_norm.weight"], eps) @ w["q_up.weight"].T
    q_nope, q_pos = q.view(b, s, HEADS, NOPE + ROPE).split([NOPE, ROPE], dim=-1)
    c_kv, k_pos = (x @ w["kv_down.weight"].T).split([KV_RANK, ROPE], dim=-1)
    k_nope, v = (rms(c_kv, w["kv_norm.weight"], eps) @ w["kv_up.weight"].T).view(b, s, HEADS, NOPE + V).split(
        [NOPE, V], dim=-1)
    cos, sin, scale = reference_tables(config, s)
    query = torch.cat([q_nope, rope(q_pos, cos, sin)], dim=-1)
    key = torch.cat([k_nope, rope(k_pos, cos, sin)[:, :, None].expand(b, s, HEADS, ROPE)], dim=-1)
    scores = torch.einsum("bshd,bthd->bhst", query, key) * scale
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    context = torch.einsum("bhst,bthd->bshd", scores.softmax(-1), v).reshape(b, s, HEADS * V)
    return context @ w["proj.weight"].T


def module(config: ModelConfig) -> MultiLatentAttention:
    ps = ParallelState.single_process(torch.device("cpu"))
    return MultiLatentAttention(config, ps, layer=0, seed=5, sequence_parallel=False, dtype=torch.float64)


CASES = {
    "q-latent": MLA,
    "q-projection": dataclasses.replace(MLA, q_lora_rank=None),
    "q-latent-yarn": dataclasses.replace(MLA, **YARN),
}


@pytest.mark.parametrize("name", list(CASES))
def test_mla_equals_the_equations_in_float64(name: str) -> None:
    config = CASES[name]
    attention = module(config)
    x = torch.randn(2, SEQ, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    upstream = torch.randn(2, SEQ, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out = attention(x.transpose(0, 1)).transpose(0, 1)  # the module is sequence first
    (out * upstream).sum().backward()
    weights = {n: p.detach().clone().requires_grad_() for n, p in attention.named_parameters()}
    expected = reference_attention(x, weights, config)
    (expected * upstream).sum().backward()
    # The rotary tables are float32 (as Hugging Face builds them): ~1e-7 relative, against ~1e-1 for a wrong slice.
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    for n, p in attention.named_parameters():
        torch.testing.assert_close(p.grad, weights[n].grad, rtol=1e-5, atol=1e-6, msg=n)


def test_mla_equals_transformers_deepseek_v3_attention() -> None:
    """The same weights in transformers' DeepseekV3Attention (half-split RoPE: ``rope_interleave=False``)."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as deepseek

    config = CASES["q-latent-yarn"]
    attention = module(config)
    hf_config = deepseek.DeepseekV3Config(
        hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=HEADS, q_lora_rank=Q_RANK,
        kv_lora_rank=KV_RANK, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V, rope_interleave=False,
        attention_bias=False, rms_norm_eps=config.norm_epsilon, max_position_embeddings=512, rope_theta=100.0,
        rope_scaling={"type": "yarn", "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
                      "beta_fast": 4.0, "beta_slow": 0.5, "mscale": 1.0, "mscale_all_dim": 0.5},
        attn_implementation="eager",
    )
    hf = deepseek.DeepseekV3Attention(hf_config, layer_idx=0).double()
    names = {"q_down": "q_a_proj", "q_norm": "q_a_layernorm", "q_up": "q_b_proj", "kv_down": "kv_a_proj_with_mqa",
             "kv_norm": "kv_a_layernorm", "kv_up": "kv_b_proj", "proj": "o_proj"}
    hf.load_state_dict({f"{names[n.split('.')[0]]}.weight": p for n, p in attention.state_dict().items()})
    rotary = deepseek.DeepseekV3RotaryEmbedding(hf_config).double()
    x = torch.randn(2, SEQ, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(SEQ)[None].expand(2, -1)
    cos, sin = rotary(x, positions)
    mask = torch.full((SEQ, SEQ), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    with torch.no_grad():
        expected, _ = hf(x, position_embeddings=(cos, sin), attention_mask=mask)
        ours = attention(x.transpose(0, 1)).transpose(0, 1)
    # Both build float32 rotary tables, in another order (inv_freq / factor against 1 / (factor base^x)).
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------ generation
def tiny_model(config: ModelConfig) -> GPTModel:
    ps = ParallelState.single_process(torch.device("cpu"))
    return GPTModel(dataclasses.replace(config, seq_length=48), ps, vocab_size=64, seed=3).eval()


@pytest.mark.parametrize("name", ["q-latent-yarn", "q-projection"])
def test_latent_cache_decodes_the_same_tokens_as_full_keys_and_values(name: str) -> None:
    model = tiny_model(CASES[name])
    prompts = [[5, 9, 2, 33, 7], [11, 3], [60, 1, 1, 8]]  # left padding: the mask covers the latent cache too
    runs = {}
    for label, extra in {"latent": {}, "full": {"cache_latent": False}, "no-cache": {"use_cache": False}}.items():
        params = GenerationParams(max_new_tokens=12, **extra)
        runs[label] = [g[0].token_ids for g in generate(model, prompts, params)]
    assert runs["latent"] == runs["full"] == runs["no-cache"]
    assert len({tuple(t) for t in runs["latent"]}) > 1  # the prompts lead somewhere different


def test_latent_cache_holds_the_latent_and_the_rope_slice_per_token() -> None:
    model = tiny_model(MLA)
    tokens = torch.tensor([[5, 9, 2, 33, 7, 1]])
    sizes = {}
    for cache_latent in (True, False):
        cache = KVCache(1, 6, cache_latent=cache_latent)
        with torch.no_grad():
            model(tokens, torch.arange(6)[None], inference_context=cache)
        sizes[cache_latent] = cache.bytes_per_token()
    assert sizes[True] == MLA.num_layers * (KV_RANK + ROPE) * 4
    assert sizes[False] == MLA.num_layers * HEADS * (NOPE + ROPE + V) * 4


@pytest.mark.parametrize("flags,message", [
    (dict(group_query_attention=True, num_query_groups=2), "drop --group-query-attention"),
    (dict(qk_pos_emb_head_dim=3), "--qk-pos-emb-head-dim 3 must be even"),
    (dict(attention_backend="local"), "--attention-backend sdpa"),
    (dict(use_rope_scaling=True, **YARN), "drop --use-rope-scaling"),
])
def test_mla_refuses_what_it_does_not_do_in_one_line(flags: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(MLA, **flags).validate()


def test_selective_recompute_reruns_the_mla_core_in_backward() -> None:
    attention = module(dataclasses.replace(MLA, recompute_granularity="selective")).train()
    core, calls = attention.core_attention, []
    attention.core_attention = lambda *tensors: calls.append(1) or core(*tensors)
    x = torch.randn(SEQ, 2, HIDDEN, dtype=torch.float64, requires_grad=True)
    attention(x).sum().backward()
    assert len(calls) == 2  # the forward, then its re-run for the backward
