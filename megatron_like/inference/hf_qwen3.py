"""Our full state <-> Hugging Face ``Qwen3ForCausalLM`` and ``Qwen3MoeForCausalLM`` weights and config (no
transformers import).

Qwen3 is Llama with two changes, both flags here: every query and key head is RMS-normalized over its
``head_dim`` features before the rotary embeddings (``--qk-layernorm``; HF's ``self_attn.q_norm`` and
``k_norm``, one ``[head_dim]`` weight each per layer), and ``head_dim`` is set apart from hidden / heads
(``--kv-channels``; 128 in every published size). So the attention, norms, embeddings and head go through
``hf_llama`` and this module adds the two norms and, for Qwen3-MoE, the experts:

=====================================================  ==========================================================
HF (in ``model.layers.<i>.``)                          ours (in ``layers.<i>.``)
=====================================================  ==========================================================
``self_attn.q_norm.weight``, ``k_norm.weight [hd]``    ``attention.q_layernorm.weight``, ``k_layernorm.weight``
``mlp.gate.weight [E, h]``                             ``mlp.router.weight [E, h]``
``mlp.experts.<e>.gate_proj``, ``up_proj``,            ``mlp.experts.weight1[e]``, ``weight2[e]`` (as Mixtral's
``down_proj``                                          w1, w3, w2: ``hf_mixtral.experts_to_hf``)
=====================================================  ==========================================================

Qwen3-MoE's routing: softmax over all experts, the top ``num_experts_per_tok``, renormalized to sum to 1 when
``norm_topk_prob`` (every published Qwen3-MoE). That is our default order, a softmax over the top-k logits
(Megatron-LM's default too: the two are the same function); ``norm_topk_prob: false`` is
``--moe-router-pre-softmax``. Dense layers among MoE ones (``mlp_only_layers``, ``decoder_sparse_step``) are our
``--moe-layer-freq`` list, their MLP of ``intermediate_size`` (``--ffn-hidden-size``; the experts'
``moe_intermediate_size`` is ``--moe-ffn-hidden-size``). Refused in one line: Qwen3's sliding window
(``use_sliding_window``), ``attention_bias``, a shared expert, capacity dropping, Sinkhorn routing.
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_like.config import ModelConfig
from megatron_like.inference import hf_llama
from megatron_like.inference.hf_mixtral import experts_from_hf, experts_to_hf

FAMILIES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
_QK_NORMS = {"attention.q_layernorm.weight": "self_attn.q_norm.weight",
             "attention.k_layernorm.weight": "self_attn.k_norm.weight"}
_EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


def check_qwen3(model: ModelConfig) -> None:
    """Raise a one-line ValueError unless ``model`` is a Qwen3 or Qwen3-MoE architecture HF can hold."""
    hf_llama.check_llama_style(model)
    problems = [
        (not model.qk_layernorm, "a model without --qk-layernorm (it converts to LlamaForCausalLM or Mixtral)"),
        (model.qkv_bias, "--add-qkv-bias (Qwen3 has no QKV bias)"),
        (model.attention_window is not None, f"--window-size {model.window_size} (Qwen3's window is per layer)"),
    ]
    if model.num_experts is not None:
        problems += [
            (bool(model.moe_shared_expert_intermediate_size), "--moe-shared-expert-intermediate-size (no shared "
                                                                "expert)"),
            (model.moe_expert_capacity_factor is not None, "--moe-expert-capacity-factor (Qwen3-MoE drops no "
                                                           "tokens)"),
            (model.moe_sinkhorn_routing, "--moe-router-load-balancing-type sinkhorn"),
        ]
    for bad, what in problems:
        if bad:
            raise ValueError(f"a Qwen3ForCausalLM / Qwen3MoeForCausalLM cannot hold {what}")


def hf_config(model: ModelConfig, vocab_size: int, eod: int | None = None) -> dict:
    """``config.json`` of a Qwen3ForCausalLM (Qwen3MoeForCausalLM with --num-experts) shaped like ``model``."""
    check_qwen3(model)
    config = hf_llama.hf_config(model, vocab_size, eod)
    config.pop("mlp_bias", None)
    config.update(architectures=[FAMILIES["qwen3"]], model_type="qwen3", attention_bias=False,
                  use_sliding_window=False, sliding_window=None, max_window_layers=model.num_layers,
                  layer_types=["full_attention"] * model.num_layers)
    if model.num_experts is not None:
        pattern = model.moe_layer_pattern
        config.update(architectures=[FAMILIES["qwen3_moe"]], model_type="qwen3_moe", num_experts=model.num_experts,
                      num_experts_per_tok=model.moe_router_topk, moe_intermediate_size=model.moe_ffn_size,
                      norm_topk_prob=not model.moe_router_pre_softmax, decoder_sparse_step=1,
                      mlp_only_layers=[layer for layer, moe in enumerate(pattern) if not moe],
                      router_aux_loss_coef=model.moe_aux_loss_coeff, output_router_logits=False)
    return config


def moe_layer_pattern(cfg: dict) -> list[bool]:
    """Per layer of a Qwen3-MoE ``config.json``: is it an MoE layer (transformers' rule)?"""
    step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or [])
    return [layer not in dense and (layer + 1) % step == 0 for layer in range(cfg["num_hidden_layers"])]


def model_config_from_hf(cfg: dict) -> ModelConfig:
    """Our ModelConfig of a Qwen3 or Qwen3-MoE ``config.json`` (refuses variants we do not implement). The experts
    are ``num_experts`` in the published configs, ``num_local_experts`` in those transformers 5 writes."""
    family = cfg.get("model_type")
    if family not in FAMILIES:
        raise ValueError(f"model_type {family!r} is not one of {sorted(FAMILIES)}")
    if cfg.get("use_sliding_window"):
        raise ValueError("Qwen3's use_sliding_window (a window on layers from max_window_layers on) is not implemented")
    if cfg.get("attention_bias"):
        raise ValueError("attention_bias=True (biases on q, k, v and o) has no equivalent here")
    llama = {k: v for k, v in cfg.items() if k not in ("sliding_window", "attention_bias")}
    model = dataclasses.replace(hf_llama.model_config_from_hf(dict(llama, model_type="llama")), qk_layernorm=True)
    if family == "qwen3":
        return model
    pattern = moe_layer_pattern(cfg)
    if not any(pattern):
        raise ValueError("this Qwen3-MoE config has no MoE layer (mlp_only_layers / decoder_sparse_step): convert "
                         "it as a dense model")
    return dataclasses.replace(
        model, num_experts=cfg.get("num_experts", cfg.get("num_local_experts")),
        moe_router_topk=cfg["num_experts_per_tok"], moe_ffn_hidden_size=cfg["moe_intermediate_size"],
        moe_router_pre_softmax=not cfg.get("norm_topk_prob", False),
        moe_layer_freq="1" if all(pattern) else str([int(moe) for moe in pattern]),
        moe_aux_loss_coeff=cfg.get("router_aux_loss_coef", 0.0))


def _moe_layers(model: ModelConfig) -> list[int]:
    return [layer for layer, moe in enumerate(model.moe_layer_pattern) if moe]


def to_hf_state(full: dict[str, torch.Tensor], model: ModelConfig, vocab_size: int) -> dict[str, torch.Tensor]:
    """HF tensors of our full state (``hf_llama.to_hf_state`` for everything but the q/k norms and the experts)."""
    check_qwen3(model)
    moe = tuple(f"layers.{layer}.mlp." for layer in _moe_layers(model))
    dense = {k: v for k, v in full.items() if not k.startswith(moe) and k.split(".", 2)[-1] not in _QK_NORMS}
    out = hf_llama.to_hf_state(dense, dataclasses.replace(model, num_experts=None), vocab_size)
    for layer in range(model.num_layers):
        for ours, hf in _QK_NORMS.items():
            out[f"model.layers.{layer}.{hf}"] = full[f"layers.{layer}.{ours}"]
    for layer in _moe_layers(model):
        ours, hf = f"layers.{layer}.mlp.", f"model.layers.{layer}.mlp."
        out[hf + "gate.weight"] = full[ours + "router.weight"]
        for e, weights in enumerate(experts_to_hf(full[ours + "experts.weight1"], full[ours + "experts.weight2"])):
            for proj, weight in zip(_EXPERT_PROJS, weights):
                out[f"{hf}experts.{e}.{proj}.weight"] = weight
    return {k: v.float().contiguous().clone() for k, v in out.items()}


def from_hf_state(hf: dict[str, torch.Tensor], model: ModelConfig, padded_vocab_size: int) -> dict[str, torch.Tensor]:
    """Our full state (vocabulary zero-padded to ``padded_vocab_size``) of HF Qwen3 / Qwen3-MoE tensors."""
    moe = tuple(f"model.layers.{layer}.mlp." for layer in _moe_layers(model))
    norms = tuple(_QK_NORMS.values())
    rest = {k: v for k, v in hf.items() if not k.startswith(moe) and not k.endswith(norms)}
    full = hf_llama.from_hf_state(rest, dataclasses.replace(model, num_experts=None), padded_vocab_size)
    for layer in range(model.num_layers):
        for ours, name in _QK_NORMS.items():
            full[f"layers.{layer}.{ours}"] = hf[f"model.layers.{layer}.{name}"].float().clone()
    expected = {f"{prefix}gate.weight" for prefix in moe} | {
        f"{prefix}experts.{e}.{proj}.weight" for prefix in moe for e in range(model.num_experts or 0)
        for proj in _EXPERT_PROJS}
    unknown = sorted(k for k in hf if k.startswith(moe) and k not in expected)
    if unknown:
        raise KeyError(f"unexpected tensor {unknown[0]!r} in a Qwen3-MoE checkpoint")
    for layer, prefix in zip(_moe_layers(model), moe):
        ours = f"layers.{layer}.mlp."
        full[ours + "router.weight"] = hf[prefix + "gate.weight"].float().clone()
        experts = [tuple(hf[f"{prefix}experts.{e}.{proj}.weight"] for proj in _EXPERT_PROJS)
                   for e in range(model.num_experts)]
        full[ours + "experts.weight1"], full[ours + "experts.weight2"] = experts_from_hf(experts)
    return full
