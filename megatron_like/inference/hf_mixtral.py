"""Our full state <-> Hugging Face ``MixtralForCausalLM`` weights and config (no transformers import).

Mixtral is Mistral with every MLP replaced by ``E`` SwiGLU experts and a top-k router (docs/moe.md), so the
attention, norms, embeddings and head go through ``hf_llama`` unchanged and this module maps the MoE part.
The names are those of the published checkpoints (which transformers also writes with ``save_pretrained``):

=====================================================  ==========================================================
HF (in ``model.layers.<i>.block_sparse_moe.``)         ours (in ``layers.<i>.mlp.``)
=====================================================  ==========================================================
``gate.weight [E, h]``                                 ``router.weight [E, h]``
``experts.<e>.w1.weight`` (gate), ``w3`` (up)          ``experts.weight1[e] [h, 2 f]``: the transposed SwiGLU fc1,
``[f, h]``                                             columns interleaved (2 i gate i, 2 i + 1 up i; docs/models.md)
``experts.<e>.w2.weight [h, f]``                       ``experts.weight2[e] [f, h]``: its transpose
=====================================================  ==========================================================

Routing agrees: HF takes the softmax over all experts, keeps the top k and renormalizes them, which equals our
default order (softmax over the top-k logits). Only layouts HF can hold convert: every layer MoE, no shared
expert, no capacity dropping, the default top-k order, no Sinkhorn (its eval weights are not renormalized).
``router_aux_loss_coef`` and ``--moe-aux-loss-coeff`` are copied into each other although the losses differ in
scale (HF's is k times ours and pools the layers): a training choice, not part of the model.
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_like.config import ModelConfig
from megatron_like.inference import hf_llama

ARCHITECTURE = "MixtralForCausalLM"
_MOE = ".block_sparse_moe."


def check_mixtral(model: ModelConfig) -> None:
    """Raise a one-line ValueError unless ``model`` is an MoE model a ``MixtralForCausalLM`` can hold."""
    hf_llama.check_llama_style(model)
    if model.num_experts is None:
        raise ValueError("this checkpoint has no --num-experts: it converts to LlamaForCausalLM, not Mixtral")
    problems = [
        (not all(model.moe_layer_pattern), f"--moe-layer-freq {model.moe_layer_freq} (Mixtral: every layer MoE)"),
        (bool(model.moe_shared_expert_intermediate_size), "--moe-shared-expert-intermediate-size (no shared expert)"),
        (model.moe_expert_capacity_factor is not None, "--moe-expert-capacity-factor (Mixtral drops no tokens)"),
        (model.moe_router_pre_softmax, "--moe-router-pre-softmax (Mixtral renormalizes the top k)"),
        (model.moe_router_load_balancing_type == "sinkhorn", "--moe-router-load-balancing-type sinkhorn"),
        (model.qkv_bias, "--add-qkv-bias"),
    ]
    for bad, flag in problems:
        if bad:
            raise ValueError(f"a MixtralForCausalLM cannot hold {flag}")


def hf_config(model: ModelConfig, vocab_size: int, eod: int | None = None) -> dict:
    """``config.json`` of a MixtralForCausalLM shaped like ``model``."""
    check_mixtral(model)
    config = hf_llama.hf_config(model, vocab_size, eod)
    for key in ("attention_bias", "mlp_bias"):
        config.pop(key, None)
    config.update(architectures=[ARCHITECTURE], model_type="mixtral", intermediate_size=model.moe_ffn_size,
                  num_local_experts=model.num_experts, num_experts_per_tok=model.moe_router_topk,
                  router_aux_loss_coef=model.moe_aux_loss_coeff, router_jitter_noise=0.0,
                  sliding_window=model.attention_window,
                  output_router_logits=False)
    return config


def model_config_from_hf(cfg: dict) -> ModelConfig:
    """Our ModelConfig of a Mixtral ``config.json`` (Mistral's rules for the rest)."""
    if cfg.get("model_type") != "mixtral":
        raise ValueError(f"model_type {cfg.get('model_type')!r} is not 'mixtral'")
    dense = hf_llama.model_config_from_hf(dict(cfg, model_type="mistral"))
    return dataclasses.replace(dense, num_experts=cfg["num_local_experts"], moe_router_topk=cfg["num_experts_per_tok"],
                               moe_ffn_hidden_size=cfg["intermediate_size"],
                               moe_aux_loss_coeff=cfg.get("router_aux_loss_coef", 0.0))


def to_hf_state(full: dict[str, torch.Tensor], model: ModelConfig, vocab_size: int) -> dict[str, torch.Tensor]:
    """HF tensors of our full state (``hf_llama.to_hf_state`` for everything but the MoE layers)."""
    check_mixtral(model)
    dense = {k: v for k, v in full.items() if ".mlp." not in k}
    out = hf_llama.to_hf_state(dense, dataclasses.replace(model, num_experts=None), vocab_size)
    for layer in range(model.num_layers):
        ours, hf = f"layers.{layer}.mlp.", f"model.layers.{layer}{_MOE}"
        out[hf + "gate.weight"] = full[ours + "router.weight"]
        for e, (gate, up, down) in enumerate(experts_to_hf(full[ours + "experts.weight1"],
                                                           full[ours + "experts.weight2"])):
            out[f"{hf}experts.{e}.w1.weight"], out[f"{hf}experts.{e}.w3.weight"] = gate, up
            out[f"{hf}experts.{e}.w2.weight"] = down
    return {k: v.float().contiguous().clone() for k, v in out.items()}


def experts_to_hf(weight1: torch.Tensor, weight2: torch.Tensor
                  ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Our ``experts.weight1 [E, h, 2 f]`` (interleaved gate/up columns) and ``weight2 [E, f, h]`` -> per expert
    HF's ``(gate [f, h], up [f, h], down [h, f])`` (Mixtral's w1, w3, w2; Qwen3-MoE's gate/up/down_proj)."""
    experts = []
    for w1, w2 in zip(weight1, weight2):
        pairs = w1.t().reshape(-1, 2, w1.shape[0])  # [f, (gate, up), h]
        experts.append((pairs[:, 0], pairs[:, 1], w2.t()))
    return experts


def experts_from_hf(experts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per expert HF's ``(gate [f, h], up [f, h], down [h, f])`` -> our fp32 ``weight1 [E, h, 2 f]`` (gate/up
    columns interleaved, docs/models.md) and ``weight2 [E, f, h]``; the inverse of :func:`experts_to_hf`."""
    weight1 = [torch.stack([gate, up], dim=1).reshape(-1, gate.shape[1]).t() for gate, up, _ in experts]
    weight2 = [down.t() for _, _, down in experts]
    return torch.stack(weight1).float().contiguous(), torch.stack(weight2).float().contiguous()


def from_hf_state(hf: dict[str, torch.Tensor], model: ModelConfig, padded_vocab_size: int) -> dict[str, torch.Tensor]:
    """Our full state (vocabulary zero-padded to ``padded_vocab_size``) of HF Mixtral tensors."""
    full = hf_llama.from_hf_state({k: v for k, v in hf.items() if _MOE not in k}, model, padded_vocab_size)
    unknown = [k for k in hf if _MOE in k and not (k.endswith("gate.weight") or ".experts." in k)]
    if unknown:
        raise KeyError(f"unexpected tensor {unknown[0]!r} in a Mixtral checkpoint")
    for layer in range(model.num_layers):
        hf_prefix, ours = f"model.layers.{layer}{_MOE}", f"layers.{layer}.mlp."
        full[ours + "router.weight"] = hf[hf_prefix + "gate.weight"].float().clone()
        experts = [tuple(hf[f"{hf_prefix}experts.{e}.{w}.weight"] for w in ("w1", "w3", "w2"))
                   for e in range(model.num_experts)]
        full[ours + "experts.weight1"], full[ours + "experts.weight2"] = experts_from_hf(experts)
    return full
