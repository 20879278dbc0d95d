"""Our full GPT state <-> Hugging Face ``GPT2LMHeadModel`` weights and config (no transformers import).

Three layout differences are mended here:

* our fused QKV output features are ordered per head ``[heads, 3, head_dim]`` (so a tp slice holds whole
  heads); HF's ``c_attn`` orders them ``[3, heads, head_dim]``;
* HF's ``Conv1D`` stores weights ``[in, out]``, the transpose of ``nn.Linear``'s ``[out, in]``;
* our vocabulary is padded (to a multiple of --make-vocab-size-divisible-by x tp); HF's is the real one.

A *full state* is ``megatron_like.model.state``'s: global layer names, the whole (tp = 1) tensors.
"""

from __future__ import annotations

import json
import os
import shutil

import torch

from megatron_like.config import ModelConfig

HF_PREFIX = "transformer."


def _qkv_ours_to_hf(w: torch.Tensor, heads: int) -> torch.Tensor:
    """``[heads * 3 * hd, ...]`` per-head order -> ``[3 * heads * hd, ...]`` q|k|v order (dim 0)."""
    rest = w.shape[1:]
    return w.reshape(heads, 3, -1, *rest).transpose(0, 1).reshape(w.shape[0], *rest)


def _qkv_hf_to_ours(w: torch.Tensor, heads: int) -> torch.Tensor:
    rest = w.shape[1:]
    return w.reshape(3, heads, -1, *rest).transpose(0, 1).reshape(w.shape[0], *rest)


def check_gpt2_style(model: ModelConfig) -> None:
    """Raise a one-line ValueError unless ``model`` is a GPT-2 architecture (learned positions, LayerNorm,
    GELU, biases, one key/value head per query head, full causal attention)."""
    wanted = [("position_embedding_type", "learned_absolute"), ("normalization", "LayerNorm"), ("swiglu", False),
              ("linear_bias", True), ("query_groups", model.num_attention_heads)]
    for field, value in wanted:
        if getattr(model, field) != value:
            raise ValueError(f"this checkpoint has {field}={getattr(model, field)!r}, not GPT-2's {value!r} "
                             "(Llama-style checkpoints convert to LlamaForCausalLM / Qwen2ForCausalLM)")
    if model.attention_window is not None:
        raise ValueError(f"this checkpoint has --window-size {model.window_size}: GPT2LMHeadModel has no sliding "
                         "window (a Llama-style model with one converts to MistralForCausalLM)")


def hf_config(model: ModelConfig, vocab_size: int, eod: int | None = None) -> dict:
    """The ``config.json`` of a GPT2LMHeadModel shaped like ``model`` with ``vocab_size`` real tokens."""
    check_gpt2_style(model)
    eos = eod if eod is not None else vocab_size - 1
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": vocab_size,
        "n_positions": model.max_positions,
        "n_embd": model.hidden_size,
        "n_layer": model.num_layers,
        "n_head": model.num_attention_heads,
        "n_inner": model.ffn_size,
        "activation_function": "gelu_new",  # GELU, tanh approximation: ours
        "resid_pdrop": model.hidden_dropout,
        "embd_pdrop": model.hidden_dropout,
        "attn_pdrop": model.attention_dropout,
        "layer_norm_epsilon": model.norm_epsilon,
        "initializer_range": model.init_method_std,
        "bos_token_id": eos,
        "eos_token_id": eos,
        "tie_word_embeddings": not model.untie_embeddings_and_output_weights,
        "scale_attn_weights": True,
        "dtype": "float32",
    }


def model_config_from_hf(cfg: dict) -> ModelConfig:
    """Our ModelConfig of a GPT-2 ``config.json`` (refuses variants we do not implement)."""
    if cfg.get("model_type", "gpt2") != "gpt2":
        raise ValueError(f"model_type {cfg['model_type']!r} is not GPT-2 (Llama-family models have their own "
                         "converter: megatron_like/inference/hf_llama.py)")
    if cfg.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"activation {cfg['activation_function']!r} is not GELU-tanh: not convertible")
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
        if cfg.get(flag):
            raise ValueError(f"GPT-2 option {flag}=True has no equivalent here")
    if cfg.get("scale_attn_weights") is False:
        raise ValueError("scale_attn_weights=False has no equivalent here")
    hidden = cfg["n_embd"]
    return ModelConfig(
        num_layers=cfg["n_layer"], hidden_size=hidden, num_attention_heads=cfg["n_head"],
        ffn_hidden_size=None if cfg.get("n_inner") in (None, 4 * hidden) else cfg["n_inner"],
        seq_length=cfg["n_positions"],
        max_position_embeddings=cfg["n_positions"], vocab_size=cfg["vocab_size"],
        hidden_dropout=cfg.get("resid_pdrop", 0.1), attention_dropout=cfg.get("attn_pdrop", 0.1),
        init_method_std=cfg.get("initializer_range", 0.02), norm_epsilon=cfg.get("layer_norm_epsilon", 1e-5),
        untie_embeddings_and_output_weights=not cfg.get("tie_word_embeddings", True),
    )


_LAYER_MAP = {  # ours (in layers.<i>.) -> HF (in transformer.h.<i>.), with how to transform
    "ln1.weight": "ln_1.weight", "ln1.bias": "ln_1.bias",
    "attention.qkv.weight": "attn.c_attn.weight", "attention.qkv.bias": "attn.c_attn.bias",
    "attention.proj.weight": "attn.c_proj.weight", "attention.proj.bias": "attn.c_proj.bias",
    "ln2.weight": "ln_2.weight", "ln2.bias": "ln_2.bias",
    "mlp.fc1.weight": "mlp.c_fc.weight", "mlp.fc1.bias": "mlp.c_fc.bias",
    "mlp.fc2.weight": "mlp.c_proj.weight", "mlp.fc2.bias": "mlp.c_proj.bias",
}
_TOP_MAP = {
    "embedding.word_embeddings.weight": "wte.weight", "embedding.position_embeddings.weight": "wpe.weight",
    "final_layernorm.weight": "ln_f.weight", "final_layernorm.bias": "ln_f.bias",
}


def to_hf_state(full: dict[str, torch.Tensor], model: ModelConfig, vocab_size: int) -> dict[str, torch.Tensor]:
    """HF GPT2LMHeadModel tensors (``transformer.*``, ``lm_head.weight`` when untied) of our full state."""
    check_gpt2_style(model)
    heads = model.num_attention_heads
    out: dict[str, torch.Tensor] = {}
    for name, tensor in full.items():
        if name in _TOP_MAP:
            if name == "embedding.word_embeddings.weight":
                tensor = tensor[:vocab_size]
            out[HF_PREFIX + _TOP_MAP[name]] = tensor
        elif name == "output_layer.weight":
            out["lm_head.weight"] = tensor[:vocab_size]
        else:
            _, layer, rest = name.split(".", 2)
            if rest.startswith("attention.qkv."):
                tensor = _qkv_ours_to_hf(tensor, heads)
            if rest.endswith("weight") and not rest.startswith("ln"):
                tensor = tensor.t()  # nn.Linear [out, in] -> Conv1D [in, out]
            out[f"{HF_PREFIX}h.{layer}.{_LAYER_MAP[rest]}"] = tensor
    return {k: v.float().contiguous().clone() for k, v in out.items()}


def finish_full_state(full: dict[str, torch.Tensor], model: ModelConfig,
                      padded_vocab_size: int) -> dict[str, torch.Tensor]:
    """The last step of every HF converter: pad the vocabulary rows ``[v, h] -> [padded_vocab_size, h]`` with
    zeros, check an untied model got its head, and return fp32 contiguous copies."""
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if name in full:
            t = full[name]
            full[name] = torch.cat([t, t.new_zeros(padded_vocab_size - t.shape[0], t.shape[1])])
    if model.untie_embeddings_and_output_weights and "output_layer.weight" not in full:
        raise KeyError("config says tie_word_embeddings=False but there is no lm_head.weight")
    return {k: v.float().contiguous().clone() for k, v in full.items()}


def from_hf_state(hf: dict[str, torch.Tensor], model: ModelConfig, padded_vocab_size: int) -> dict[str, torch.Tensor]:
    """Our full state (vocabulary zero-padded to ``padded_vocab_size``) of HF GPT-2 tensors."""
    heads = model.num_attention_heads
    hf = {(k if k.startswith((HF_PREFIX, "lm_head.")) else HF_PREFIX + k): v for k, v in hf.items()}
    reverse_top = {v: k for k, v in _TOP_MAP.items()}
    reverse_layer = {v: k for k, v in _LAYER_MAP.items()}
    full: dict[str, torch.Tensor] = {}
    for name, tensor in hf.items():
        if name == "lm_head.weight":
            if model.untie_embeddings_and_output_weights:
                full["output_layer.weight"] = tensor
            continue
        short = name[len(HF_PREFIX):]
        if short in reverse_top:
            full[reverse_top[short]] = tensor
            continue
        if not short.startswith("h."):
            raise KeyError(f"unexpected GPT-2 tensor {name!r}")
        _, layer, rest = short.split(".", 2)
        if rest.endswith((".attn.bias", ".masked_bias")) or rest in ("attn.bias", "attn.masked_bias"):
            continue  # old checkpoints' causal-mask buffers
        ours = reverse_layer[rest]
        if ours.endswith("weight") and not ours.startswith("ln"):
            tensor = tensor.t()
        if ours.startswith("attention.qkv."):
            tensor = _qkv_hf_to_ours(tensor, heads)
        full[f"layers.{layer}.{ours}"] = tensor
    return finish_full_state(full, model, padded_vocab_size)


# --------------------------------------------------------------------------------------------------
# Directories
# --------------------------------------------------------------------------------------------------


def save_hf_dir(path: str, hf_state: dict[str, torch.Tensor], config: dict,
                tokenizer_files: dict[str, str] | None = None) -> None:
    """Write ``config.json``, ``model.safetensors`` and tokenizer files (``{name in dir: source path}``)."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    state = dict(hf_state)
    if config.get("tie_word_embeddings", True):
        state.pop("lm_head.weight", None)
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for name, source in (tokenizer_files or {}).items():
        shutil.copyfile(source, os.path.join(path, name))
    if tokenizer_files and "vocab.json" in tokenizer_files:
        eos = "<|endoftext|>"
        with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "GPT2Tokenizer", "bos_token": eos, "eos_token": eos, "unk_token": eos,
                       "model_max_length": config.get("n_positions", config.get("max_position_embeddings"))},
                      f, indent=2)


def load_hf_dir(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, tensors) of a Hugging Face GPT-2 directory (safetensors, sharded or not, or .bin)."""
    config, tensors = read_hf_dir(path)
    if config.get("model_type", "gpt2") != "gpt2":
        raise ValueError(f"{path} holds a {config.get('model_type')!r} model, not GPT-2")
    return config, tensors


def read_hf_dir(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, tensors) of any Hugging Face model directory (safetensors, sharded or not, or .bin)."""
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    single = os.path.join(path, "model.safetensors")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(single) or os.path.exists(index):
        from safetensors.torch import load_file

        files = [single]
        if not os.path.exists(single):
            with open(index) as f:
                files = sorted({os.path.join(path, v) for v in json.load(f)["weight_map"].values()})
        tensors: dict[str, torch.Tensor] = {}
        for file in files:
            tensors.update(load_file(file))
        return config, tensors
    binary = os.path.join(path, "pytorch_model.bin")
    if os.path.exists(binary):
        return config, torch.load(binary, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"{path} has no model.safetensors(.index.json) or pytorch_model.bin")
