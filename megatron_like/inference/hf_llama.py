"""Our full state <-> Hugging Face ``LlamaForCausalLM`` / ``MistralForCausalLM`` / ``Qwen2ForCausalLM``
weights and config (no transformers import).

The three differ here only by flags: Llama and Mistral have no biases; Mistral's ``sliding_window`` W is our
``--window-size W-1,0`` (each query sees W keys, itself included); Qwen2 adds a bias to the query/key/value
projections (our ``--add-qkv-bias``). RoPE scaling converts both ways: ``rope_type`` "llama3" (Llama 3.1-3.3) is
``--use-rope-scaling`` with its four numbers, "linear" is ``--rotary-seq-len-interpolation-factor``; other
types (dynamic, yarn, longrope) and Qwen2's per-layer sliding window are refused. Two layout differences are
mended:

* our fused QKV output features are grouped per query group ``[groups, heads/groups + 2, head_dim]``
  (each group's query heads, then its key head, then its value head; so a tp slice holds whole groups);
  HF keeps three matrices ``q_proj [heads * hd, h]``, ``k_proj`` and ``v_proj [groups * hd, h]``;
* our SwiGLU ``fc1 [2 ffn, h]`` interleaves rows (row 2i is gate i, row 2i+1 is up i, so a tp slice holds
  matching rows); HF keeps ``gate_proj`` and ``up_proj [ffn, h]``.

Both rotate "half" (pairs (i, i + hd/2)), so q and k need no permutation. Linears are ``[out, in]`` on both
sides. Our vocabulary is padded; HF's is the real one. A *full state* is ``megatron_like.model.state``'s.
"""

from __future__ import annotations

import torch

from megatron_like.config import ModelConfig
from megatron_like.inference.hf_gpt2 import finish_full_state
from megatron_like.model.rotary import rope_scaling_of

FAMILIES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}

_LAYER_MAP = {  # ours (in layers.<i>.) -> HF (in model.layers.<i>.), the tensors that map one to one
    "ln1.weight": "input_layernorm.weight", "ln2.weight": "post_attention_layernorm.weight",
    "attention.proj.weight": "self_attn.o_proj.weight", "mlp.fc2.weight": "mlp.down_proj.weight",
}
_TOP_MAP = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
            "final_layernorm.weight": "model.norm.weight", "output_layer.weight": "lm_head.weight"}


def check_llama_style(model: ModelConfig) -> None:
    """Raise a one-line ValueError unless ``model`` is a Llama-family architecture HF can hold."""
    wanted = [("position_embedding_type", "rope", "--position-embedding-type rope"),
              ("normalization", "RMSNorm", "--normalization RMSNorm"), ("swiglu", True, "--swiglu"),
              ("linear_bias", False, "--disable-bias-linear"), ("rotary_percent", 1.0, "--rotary-percent 1.0")]
    for field, value, flag in wanted:
        if getattr(model, field) != value:
            raise ValueError(f"this checkpoint has {field}={getattr(model, field)!r}; a Llama/Qwen2 model needs "
                             f"{flag} (GPT-2-style checkpoints convert to GPT2LMHeadModel)")


def rope_parameters(model: ModelConfig) -> dict:
    """Hugging Face's ``rope_parameters`` (transformers >= 5; ``rope_scaling`` before) of ``model``'s rotary flags,
    read through the model's own :func:`rope_scaling_of` (HF's field names are those of :class:`RopeScaling`)."""
    parameters: dict = {"rope_theta": float(model.rotary_base), "rope_type": "default"}
    scaling = rope_scaling_of(model)
    if scaling is not None:
        parameters.update(rope_type=scaling.kind, factor=scaling.factor)
    if scaling is not None and scaling.kind == "llama3":
        parameters.update(low_freq_factor=scaling.low_freq_factor, high_freq_factor=scaling.high_freq_factor,
                          original_max_position_embeddings=scaling.original_max_positions)
    return parameters


def rope_flags(cfg: dict) -> dict:
    """Our ModelConfig fields of a ``config.json``'s rotary settings (refuses scalings we do not implement)."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if theta != int(theta):
        raise ValueError(f"rope_theta {theta} is not a whole number (--rotary-base is an int)")
    flags: dict = {"rotary_base": int(theta)}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "llama3":
        flags.update(use_rope_scaling=True, rope_scaling_factor=float(rope["factor"]),
                     rope_scaling_low_freq_factor=float(rope["low_freq_factor"]),
                     rope_scaling_high_freq_factor=float(rope["high_freq_factor"]),
                     rope_scaling_original_max_position_embeddings=int(rope["original_max_position_embeddings"]))
    elif kind == "linear":
        flags.update(rotary_seq_len_interpolation_factor=float(rope["factor"]))
    elif kind != "default":
        raise ValueError(f"rope type {kind!r} is not implemented (default, linear and llama3 are)")
    return flags


def hf_config(model: ModelConfig, vocab_size: int, eod: int | None = None) -> dict:
    """``config.json`` of a LlamaForCausalLM (MistralForCausalLM with --window-size, Qwen2ForCausalLM with
    --add-qkv-bias) shaped like ``model``."""
    check_llama_style(model)
    window = model.attention_window
    if model.qkv_bias and window is not None:
        raise ValueError("--add-qkv-bias with --window-size has no Hugging Face family here (Qwen2's sliding "
                         "window is per layer): drop one of them")
    family = "qwen2" if model.qkv_bias else "mistral" if window is not None else "llama"
    eos = eod if eod is not None else vocab_size - 1
    rope = rope_parameters(model)
    config = {
        "architectures": [FAMILIES[family]], "model_type": family, "vocab_size": vocab_size,
        "hidden_size": model.hidden_size, "intermediate_size": model.ffn_size,
        "num_hidden_layers": model.num_layers, "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.query_groups, "head_dim": model.head_dim, "hidden_act": "silu",
        "max_position_embeddings": model.max_positions, "rms_norm_eps": model.norm_epsilon,
        "rope_theta": float(model.rotary_base),  # transformers < 5 (with rope_scaling below)
        "rope_parameters": rope,  # transformers >= 5
        "attention_dropout": model.attention_dropout, "initializer_range": model.init_method_std,
        "tie_word_embeddings": not model.untie_embeddings_and_output_weights,
        "bos_token_id": eos, "eos_token_id": eos, "dtype": "float32",
    }
    if rope["rope_type"] != "default":
        config["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    if family == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    elif family == "mistral":
        config.update(sliding_window=window)
    else:
        config.update(use_sliding_window=False, sliding_window=None)
    return config


def model_config_from_hf(cfg: dict) -> ModelConfig:
    """Our ModelConfig of a Llama / Mistral / Qwen2 ``config.json`` (refuses variants we do not implement)."""
    family = cfg.get("model_type")
    if family not in FAMILIES:
        raise ValueError(f"model_type {family!r} is not one of {sorted(FAMILIES)} (GPT-2 has its own converter)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not SiLU: SwiGLU cannot hold it")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ValueError("attention_bias/mlp_bias=True has no equivalent here (only Qwen2's QKV bias)")
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim")  # our --kv-channels where it is not hidden_size / heads (Qwen3)
    positions = cfg.get("max_position_embeddings", 2048)
    window = cfg.get("sliding_window") if family == "mistral" else None
    if family == "qwen2" and cfg.get("use_sliding_window"):
        raise ValueError("Qwen2's use_sliding_window (a window on layers from max_window_layers on) is not implemented")
    groups = cfg.get("num_key_value_heads") or heads
    return ModelConfig(
        num_layers=cfg["num_hidden_layers"], hidden_size=hidden, num_attention_heads=heads,
        kv_channels=None if head_dim in (None, hidden // heads) and hidden % heads == 0 else head_dim,
        ffn_hidden_size=cfg["intermediate_size"], seq_length=positions, max_position_embeddings=positions,
        vocab_size=cfg["vocab_size"], hidden_dropout=0.0, attention_dropout=cfg.get("attention_dropout", 0.0),
        init_method_std=cfg.get("initializer_range", 0.02), norm_epsilon=cfg.get("rms_norm_eps", 1e-6),
        untie_embeddings_and_output_weights=not cfg.get("tie_word_embeddings", False),
        position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
        group_query_attention=groups != heads, num_query_groups=groups if groups != heads else 1,
        disable_bias_linear=True, add_qkv_bias=family == "qwen2",
        window_size=None if window is None else f"{window - 1},0", **rope_flags(cfg),
    )


def _qkv_to_ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """``q [heads * hd, ...]``, ``k, v [groups * hd, ...]`` -> ours ``[(heads + 2 groups) * hd, ...]``."""
    rest = q.shape[1:]
    hd = k.shape[0] // groups
    q = q.reshape(groups, -1, hd, *rest)
    k, v = k.reshape(groups, 1, hd, *rest), v.reshape(groups, 1, hd, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _qkv_to_hf(w: torch.Tensor, heads: int, groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rest = w.shape[1:]
    per_group = heads // groups
    w = w.reshape(groups, per_group + 2, -1, *rest)
    q, k, v = w.split([per_group, 1, 1], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def swiglu_to_hf(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our SwiGLU ``fc1 [2 f, h]`` (row 2i gate i, row 2i + 1 up i) -> HF's ``gate_proj``, ``up_proj [f, h]``."""
    pairs = fc1.reshape(-1, 2, fc1.shape[1])
    return pairs[:, 0], pairs[:, 1]


def swiglu_from_hf(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """HF's ``gate_proj``, ``up_proj [f, h]`` -> our interleaved SwiGLU ``fc1 [2 f, h]``; the inverse of
    :func:`swiglu_to_hf`."""
    return torch.stack([gate, up], dim=1).reshape(-1, gate.shape[1])


def to_hf_state(full: dict[str, torch.Tensor], model: ModelConfig, vocab_size: int) -> dict[str, torch.Tensor]:
    """HF tensors (``model.*``, ``lm_head.weight`` when untied) of our full state, vocabulary trimmed."""
    check_llama_style(model)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in full.items():
        if name in _TOP_MAP:
            out[_TOP_MAP[name]] = tensor[:vocab_size] if "norm" not in name else tensor
            continue
        _, layer, rest = name.split(".", 2)
        prefix = f"model.layers.{layer}."
        if rest.startswith("attention.qkv."):
            kind = rest.rsplit(".", 1)[1]  # weight or bias
            q, k, v = _qkv_to_hf(tensor, model.num_attention_heads, model.query_groups)
            for proj, part in zip(("q_proj", "k_proj", "v_proj"), (q, k, v)):
                out[f"{prefix}self_attn.{proj}.{kind}"] = part
        elif rest == "mlp.fc1.weight":
            out[prefix + "mlp.gate_proj.weight"], out[prefix + "mlp.up_proj.weight"] = swiglu_to_hf(tensor)
        else:
            out[prefix + _LAYER_MAP[rest]] = tensor
    return {k: v.float().contiguous().clone() for k, v in out.items()}


def from_hf_state(hf: dict[str, torch.Tensor], model: ModelConfig, padded_vocab_size: int) -> dict[str, torch.Tensor]:
    """Our full state (vocabulary zero-padded to ``padded_vocab_size``) of HF Llama/Mistral/Qwen2 tensors."""
    reverse_top = {v: k for k, v in _TOP_MAP.items()}
    reverse_layer = {v: k for k, v in _LAYER_MAP.items()}
    groups = model.query_groups
    full: dict[str, torch.Tensor] = {}
    for name, tensor in hf.items():
        if name in reverse_top:
            if name != "lm_head.weight" or model.untie_embeddings_and_output_weights:
                full[reverse_top[name]] = tensor
            continue
        if name.endswith("rotary_emb.inv_freq"):
            continue  # old checkpoints' rotary buffer: recomputed from rope_theta
        if not name.startswith("model.layers."):
            raise KeyError(f"unexpected tensor {name!r} in a Llama-family checkpoint")
        layer, rest = name[len("model.layers."):].split(".", 1)
        prefix = f"model.layers.{layer}."
        if rest.startswith("self_attn.q_proj."):
            kind = rest.rsplit(".", 1)[1]
            q, k, v = (hf[f"{prefix}self_attn.{p}.{kind}"] for p in ("q_proj", "k_proj", "v_proj"))
            full[f"layers.{layer}.attention.qkv.{kind}"] = _qkv_to_ours(q, k, v, groups)
        elif rest == "mlp.gate_proj.weight":
            full[f"layers.{layer}.mlp.fc1.weight"] = swiglu_from_hf(tensor, hf[prefix + "mlp.up_proj.weight"])
        elif rest in reverse_layer:
            full[f"layers.{layer}.{reverse_layer[rest]}"] = tensor
        elif not rest.startswith(("self_attn.k_proj.", "self_attn.v_proj.", "mlp.up_proj.")):
            raise KeyError(f"unexpected tensor {name!r} in a Llama-family checkpoint")
    return finish_full_state(full, model, padded_vocab_size)
