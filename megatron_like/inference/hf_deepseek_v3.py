"""Our full state <-> Hugging Face ``DeepseekV3ForCausalLM`` weights and config (no transformers import).

DeepSeek-V3 is our ``--multi-latent-attention`` model with SwiGLU MLPs, its first ``first_k_dense_replace`` layers
dense and the rest MoE (``--moe-layer-freq [0]*k+[1]*(L-k)``) with sigmoid routing in groups, a scaling factor, the
expert bias and one shared expert; its multi-token prediction depths are layers ``num_hidden_layers + k``.

=====================================================  ==========================================================
HF (in ``model.layers.<i>.``)                          ours (in ``layers.<i>.``)
=====================================================  ==========================================================
``self_attn.q_a_proj``, ``q_a_layernorm``, ``q_b_proj``  ``attention.q_down``, ``q_norm``, ``q_up`` (rope rows
(or ``q_proj`` without the query latent)               permuted, below; ``attention.q_proj``)
``self_attn.kv_a_proj_with_mqa``, ``kv_a_layernorm``,  ``attention.kv_down`` (rope rows permuted), ``kv_norm``,
``kv_b_proj``, ``o_proj``                              ``kv_up``, ``proj``
``mlp.gate_proj``, ``up_proj``, ``down_proj`` (dense)  ``mlp.fc1`` (rows interleaved: ``hf_llama``), ``mlp.fc2``
``mlp.gate.weight``, ``gate.e_score_correction_bias``  ``mlp.router.weight``, ``mlp.router.expert_bias`` (a buffer)
``mlp.experts.<e>.gate_proj``, ``up_proj``,            ``mlp.experts.weight1[e]``, ``weight2[e]``
``down_proj``                                          (``hf_mixtral.experts_to_hf``)
``mlp.shared_experts.gate_proj``, ``up_proj``,         ``mlp.shared_experts.fc1``, ``fc2``
``down_proj``
=====================================================  ==========================================================

Multi-token prediction depth ``k`` (ours ``mtp.layers.<k>.``) is DeepSeek's published layer ``num_hidden_layers + k``:
``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` (our ``final_layernorm``), its transformer layer's tensors
under the names above (ours in ``transformer_layer.0.``), and copies of the word embedding (``embed_tokens``) and of
the output layer (``shared_head.head``), which our depths share with the model (from-hf checks the copies are equal).
transformers' ``DeepseekV3ForCausalLM`` holds no MTP weights (it skips them when loading, and a model it saves has
none): from-hf then converts the model without MTP.

RoPE: ``rope_interleave`` (DeepSeek's default) rotates the pairs ``(2i, 2i + 1)`` of the rope slice, ours the halves
``(i, i + d/2)``; rotating pairs of ``x`` equals rotating halves of ``x`` with its even features first, so from-hf
reorders the rope rows of ``q_b_proj`` (per head) and ``kv_a_proj_with_mqa`` evens-then-odds (to-hf back). Scores
``q . k`` are unchanged because queries and keys are reordered alike. YaRN (``rope_type: yarn``) is ``--rope-type
yarn`` with its six numbers.

Routing: HF scores ``sigmoid(logits)``, adds ``e_score_correction_bias`` to choose the ``topk_group`` best of
``n_group`` groups (by their two best scores) and the top ``num_experts_per_tok`` inside, weighs by the unbiased
scores divided by their sum (``norm_topk_prob``) and multiplies by ``routed_scaling_factor``: our router with
``--moe-router-score-function sigmoid`` (which normalizes when k > 1), the group flags and
``--moe-router-topk-scaling-factor``. ``topk_method`` says whether the bias is trained ("noaux_tc", DeepSeek-V3's:
``--moe-router-enable-expert-bias``) or stays zero ("greedy"); ``seq_aux`` and ``aux_loss_alpha`` are
``--moe-router-load-balancing-type seq_aux_loss`` and ``--moe-aux-loss-coeff`` (training choices HF does not use).
Refused in one line: MoE layers other than the last ``L - k``, no shared expert (or one not a multiple of the
experts' size), softmax or Sinkhorn routing, capacity dropping, groups of one expert, other RoPE scalings.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Collection

import torch

from megatron_like.config import ModelConfig
from megatron_like.inference import hf_llama
from megatron_like.inference.hf_gpt2 import finish_full_state
from megatron_like.inference.hf_mixtral import experts_from_hf, experts_to_hf
from megatron_like.model.multi_latent_attention import reorder_rope_rows
from megatron_like.model.rotary import rope_scaling_of

ARCHITECTURE = "DeepseekV3ForCausalLM"
FAMILIES = {"deepseek_v3": ARCHITECTURE}
_ATTENTION = {  # ours (in attention.) -> HF (in self_attn.)
    "q_down.weight": "q_a_proj.weight", "q_norm.weight": "q_a_layernorm.weight", "q_up.weight": "q_b_proj.weight",
    "q_proj.weight": "q_proj.weight", "kv_down.weight": "kv_a_proj_with_mqa.weight",
    "kv_norm.weight": "kv_a_layernorm.weight", "kv_up.weight": "kv_b_proj.weight", "proj.weight": "o_proj.weight",
}
_MTP = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
        "final_layernorm.weight": "shared_head.norm.weight"}  # ours (in mtp.layers.<k>.) -> HF (in model.layers.<L+k>.)
_YARN = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
_YARN_FIELDS = ("rotary_scaling_factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                "mscale_all_dim")
_PROJS = ("gate_proj", "up_proj", "down_proj")


def dense_prefix(model: ModelConfig) -> int:
    """HF's ``first_k_dense_replace``: the dense layers before the MoE ones (all layers without experts)."""
    pattern = model.moe_layer_pattern
    return pattern.index(True) if any(pattern) else model.num_layers


def check_deepseek_v3(model: ModelConfig) -> None:
    """Raise a one-line ValueError unless ``model`` is an architecture a ``DeepseekV3ForCausalLM`` can hold."""
    hf_llama.check_llama_style(model)
    scaling = rope_scaling_of(model)
    k = dense_prefix(model)
    problems = [
        (not model.multi_latent_attention, "a model without --multi-latent-attention"),
        (model.qk_layernorm, "--qk-layernorm"),
        (model.attention_window is not None, f"--window-size {model.window_size}"),
        (scaling is not None and scaling.kind != "yarn", "RoPE scaling other than --rope-type yarn"),
    ]
    if model.num_experts is not None:
        shared, expert = model.moe_shared_expert_intermediate_size or 0, model.moe_ffn_size
        groups = model.moe_router_num_groups or 1
        problems += [
            (model.moe_layer_pattern[k:] != [True] * (model.num_layers - k),
             f"--moe-layer-freq {model.moe_layer_freq} (DeepSeek-V3: dense layers first, then MoE ones)"),
            (model.moe_router_score_function != "sigmoid",
             "--moe-router-score-function softmax (it scores by sigmoid)"),
            (model.moe_sinkhorn_routing, "--moe-router-load-balancing-type sinkhorn"),
            (model.moe_expert_capacity_factor is not None, "--moe-expert-capacity-factor (it drops no tokens)"),
            (shared == 0 or shared % expert != 0, f"--moe-shared-expert-intermediate-size {shared or None} (a "
                                                  f"multiple of the experts' size {expert}: n_shared_experts)"),
            (model.num_experts // groups < 2, f"--moe-router-num-groups {groups} of fewer than 2 experts"),
        ]
    for bad, what in problems:
        if bad:
            raise ValueError(f"a {ARCHITECTURE} cannot hold {what}")


def hf_config(model: ModelConfig, vocab_size: int, eod: int | None = None) -> dict:
    """``config.json`` of a DeepseekV3ForCausalLM shaped like ``model``."""
    check_deepseek_v3(model)
    eos = eod if eod is not None else vocab_size - 1
    rope: dict = {"rope_theta": float(model.rotary_base), "rope_type": "default"}
    if model.rope_type == "yarn":
        rope.update({"rope_type": "yarn"} | {hf: getattr(model, ours) for hf, ours in zip(_YARN, _YARN_FIELDS)})
    config = {
        "architectures": [ARCHITECTURE], "model_type": "deepseek_v3", "vocab_size": vocab_size,
        "hidden_size": model.hidden_size, "intermediate_size": model.ffn_size, "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads, "num_key_value_heads": model.num_attention_heads,
        "q_lora_rank": model.q_lora_rank, "kv_lora_rank": model.kv_lora_rank, "qk_nope_head_dim": model.qk_head_dim,
        "qk_rope_head_dim": model.qk_pos_emb_head_dim, "v_head_dim": model.v_head_dim, "hidden_act": "silu",
        "max_position_embeddings": model.max_positions, "rms_norm_eps": model.norm_epsilon,
        "rope_theta": float(model.rotary_base), "rope_parameters": rope, "rope_interleave": True,
        "attention_bias": False, "attention_dropout": model.attention_dropout,
        "initializer_range": model.init_method_std,
        "tie_word_embeddings": not model.untie_embeddings_and_output_weights,
        "first_k_dense_replace": dense_prefix(model), "num_nextn_predict_layers": model.mtp_num_layers or 0,
        "bos_token_id": eos, "eos_token_id": eos, "dtype": "float32",
    }
    if model.rope_type == "yarn":  # transformers < 5 and DeepSeek's own code read rope_scaling
        config["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    if model.num_experts is not None:
        config.update(
            n_routed_experts=model.num_experts, num_experts_per_tok=model.moe_router_topk,
            moe_intermediate_size=model.moe_ffn_size,
            n_shared_experts=model.moe_shared_expert_intermediate_size // model.moe_ffn_size,
            n_group=model.moe_router_num_groups or 1, topk_group=model.moe_router_group_topk or 1,
            routed_scaling_factor=model.moe_router_topk_scaling_factor or 1.0,
            norm_topk_prob=model.moe_router_topk > 1, scoring_func="sigmoid",
            topk_method="noaux_tc" if model.moe_router_enable_expert_bias else "greedy",
            seq_aux=model.moe_router_load_balancing_type == "seq_aux_loss", aux_loss_alpha=model.moe_aux_loss_coeff)
    return config


def _rope_flags(cfg: dict) -> dict:
    """Our rotary fields of a DeepSeek-V3 ``config.json`` (plain RoPE or YaRN; refuses what HF computes otherwise)."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if theta != int(theta):
        raise ValueError(f"rope_theta {theta} is not a whole number (--rotary-base is an int)")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return {"rotary_base": int(theta)}
    if kind != "yarn":
        raise ValueError(f"rope type {kind!r} is not implemented for DeepSeek-V3 (default and yarn are)")
    if rope.get("attention_factor") is not None or rope.get("truncate", True) is not True:
        raise ValueError("YaRN's attention_factor / truncate=False have no equivalent here")
    mscale, mscale_all_dim = rope.get("mscale") or 0.0, rope.get("mscale_all_dim") or 0.0
    if mscale_all_dim and not mscale:  # transformers' tables then take m(1), its softmax scale m(mscale_all_dim)^2
        raise ValueError(f"YaRN mscale_all_dim {mscale_all_dim} without mscale has no equivalent here")
    factor = rope.get("factor") or cfg["max_position_embeddings"] / rope["original_max_position_embeddings"]
    return {"rotary_base": int(theta), "rope_type": "yarn", "rotary_scaling_factor": float(factor),
            "original_max_position_embeddings": int(rope["original_max_position_embeddings"]),
            "beta_fast": float(rope.get("beta_fast") or 32.0), "beta_slow": float(rope.get("beta_slow") or 1.0),
            # Without mscale_all_dim transformers scales the tables by m(1) whatever mscale says: our mscale 1.
            "mscale": float(mscale) if mscale_all_dim else 1.0, "mscale_all_dim": float(mscale_all_dim)}


def model_config_from_hf(cfg: dict, weight_names: Collection[str] | None = None) -> ModelConfig:
    """Our ModelConfig of a DeepSeek-V3 ``config.json``. With ``weight_names`` (the checkpoint's tensors), MTP depths
    whose weights are absent (a model transformers saved) are left out."""
    if cfg.get("model_type") != "deepseek_v3":
        raise ValueError(f"model_type {cfg.get('model_type')!r} is not 'deepseek_v3'")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not SiLU: SwiGLU cannot hold it")
    if cfg.get("attention_bias"):
        raise ValueError("attention_bias=True (biases on the MLA projections) has no equivalent here")
    if cfg.get("moe_layer_freq", 1) != 1:
        raise ValueError(f"moe_layer_freq {cfg['moe_layer_freq']} (MoE on every n-th layer) is not DeepSeek-V3's")
    layers, positions = cfg["num_hidden_layers"], cfg.get("max_position_embeddings", 4096)
    depths = cfg.get("num_nextn_predict_layers", cfg.get("num_mtp_layers", 0)) or 0
    if weight_names is not None and f"model.layers.{layers}.eh_proj.weight" not in weight_names:
        if depths:
            print(f"note: config.json has {depths} MTP layer(s) but the weights hold none (transformers does not "
                  "keep them): converting without MTP", file=sys.stderr)
        depths = 0
    model = ModelConfig(
        num_layers=layers, hidden_size=cfg["hidden_size"], num_attention_heads=cfg["num_attention_heads"],
        ffn_hidden_size=cfg["intermediate_size"], seq_length=positions, max_position_embeddings=positions,
        vocab_size=cfg["vocab_size"], hidden_dropout=0.0, attention_dropout=cfg.get("attention_dropout", 0.0),
        init_method_std=cfg.get("initializer_range", 0.02), norm_epsilon=cfg.get("rms_norm_eps", 1e-6),
        untie_embeddings_and_output_weights=not cfg.get("tie_word_embeddings", False),
        position_embedding_type="rope", normalization="RMSNorm", swiglu=True, disable_bias_linear=True,
        multi_latent_attention=True, q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=cfg["kv_lora_rank"],
        qk_head_dim=cfg["qk_nope_head_dim"], qk_pos_emb_head_dim=cfg["qk_rope_head_dim"],
        v_head_dim=cfg["v_head_dim"], mtp_num_layers=depths or None, **_rope_flags(cfg))
    dense = min(cfg.get("first_k_dense_replace", 3), layers)
    if dense == layers:
        return model
    experts, topk, groups = cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg.get("n_group") or 1
    if cfg.get("norm_topk_prob", True) != (topk > 1):
        raise ValueError(f"norm_topk_prob={cfg.get('norm_topk_prob')} with num_experts_per_tok {topk}: our sigmoid "
                         "router normalizes the chosen weights exactly when k > 1")
    if not cfg.get("n_shared_experts"):
        raise ValueError("n_shared_experts 0: a DeepSeek-V3 MoE layer here has a shared expert")
    scaling = float(cfg.get("routed_scaling_factor", 1.0))
    return dataclasses.replace(
        model, num_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=cfg["moe_intermediate_size"],
        moe_layer_freq=f"[0]*{dense}+[1]*{layers - dense}" if dense else "1",
        moe_shared_expert_intermediate_size=cfg["moe_intermediate_size"] * cfg["n_shared_experts"],
        moe_router_score_function="sigmoid", moe_router_num_groups=groups if groups > 1 else None,
        moe_router_group_topk=cfg.get("topk_group") if groups > 1 else None,
        moe_router_topk_scaling_factor=scaling if scaling != 1.0 else None,
        moe_router_enable_expert_bias=cfg.get("topk_method", "noaux_tc") == "noaux_tc",
        moe_router_load_balancing_type="seq_aux_loss" if cfg.get("seq_aux") else "aux_loss",
        moe_aux_loss_coeff=cfg.get("aux_loss_alpha", 0.0))


# ---------------------------------------------------------------- tensors
def _rope_heads(model: ModelConfig, ours: str) -> int | None:
    """Heads whose rope rows attention weight ``ours`` holds (None: no rope rows)."""
    return {"q_up.weight": model.num_attention_heads, "q_proj.weight": model.num_attention_heads,
            "kv_down.weight": 1}.get(ours)


def _layer_to_hf(full: dict[str, torch.Tensor], ours: str, hf: str, model: ModelConfig,
                 moe: bool) -> dict[str, torch.Tensor]:
    """HF tensors (names from ``hf``) of our transformer layer whose names start with ``ours``."""
    out = {hf + "input_layernorm.weight": full[ours + "ln1.weight"],
           hf + "post_attention_layernorm.weight": full[ours + "ln2.weight"]}
    for name, hf_name in _ATTENTION.items():
        if ours + "attention." + name in full:
            tensor, heads = full[ours + "attention." + name], _rope_heads(model, name)
            if heads is not None:
                tensor = reorder_rope_rows(tensor, heads, model.qk_pos_emb_head_dim, to_ours=False)
            out[hf + "self_attn." + hf_name] = tensor
    mlp = "mlp.shared_experts." if moe else "mlp."
    gate, up = hf_llama.swiglu_to_hf(full[ours + mlp + "fc1.weight"])
    out |= {hf + mlp + "gate_proj.weight": gate, hf + mlp + "up_proj.weight": up,
            hf + mlp + "down_proj.weight": full[ours + mlp + "fc2.weight"]}
    if moe:
        out[hf + "mlp.gate.weight"] = full[ours + "mlp.router.weight"]
        bias = full.get(ours + "mlp.router.expert_bias")
        out[hf + "mlp.gate.e_score_correction_bias"] = torch.zeros(model.num_experts) if bias is None else bias
        experts = experts_to_hf(full[ours + "mlp.experts.weight1"], full[ours + "mlp.experts.weight2"])
        for e, weights in enumerate(experts):
            out |= {f"{hf}mlp.experts.{e}.{proj}.weight": w for proj, w in zip(_PROJS, weights)}
    return out


def to_hf_state(full: dict[str, torch.Tensor], model: ModelConfig, vocab_size: int) -> dict[str, torch.Tensor]:
    """HF tensors of our full state, vocabulary trimmed; MTP depths as DeepSeek publishes them."""
    check_deepseek_v3(model)
    embedding = full["embedding.word_embeddings.weight"][:vocab_size]
    head = full.get("output_layer.weight", embedding)[:vocab_size]
    out = {"model.embed_tokens.weight": embedding, "model.norm.weight": full["final_layernorm.weight"]}
    if model.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = head
    for layer in range(model.num_layers):
        out |= _layer_to_hf(full, f"layers.{layer}.", f"model.layers.{layer}.", model, model.is_moe_layer(layer))
    for depth in range(model.mtp_num_layers or 0):
        ours, hf, layer = f"mtp.layers.{depth}.", f"model.layers.{model.num_layers + depth}.", model.num_layers + depth
        out |= {hf + hf_name: full[ours + name] for name, hf_name in _MTP.items()}
        out |= {hf + "embed_tokens.weight": embedding, hf + "shared_head.head.weight": head}
        out |= _layer_to_hf(full, ours + "transformer_layer.0.", hf, model, model.is_moe_layer(layer))
    return {k: v.float().contiguous().clone() for k, v in out.items()}


def _layer_from_hf(hf_state: dict[str, torch.Tensor], hf: str, ours: str, model: ModelConfig, moe: bool,
                   interleaved: bool) -> dict[str, torch.Tensor]:
    """Our tensors (names from ``ours``) of the HF decoder layer whose names start with ``hf``; the inverse of
    :func:`_layer_to_hf`."""
    out = {ours + "ln1.weight": hf_state[hf + "input_layernorm.weight"],
           ours + "ln2.weight": hf_state[hf + "post_attention_layernorm.weight"]}
    for name, hf_name in _ATTENTION.items():
        if hf + "self_attn." + hf_name in hf_state:
            tensor, heads = hf_state[hf + "self_attn." + hf_name], _rope_heads(model, name)
            if heads is not None and interleaved:
                tensor = reorder_rope_rows(tensor, heads, model.qk_pos_emb_head_dim, to_ours=True)
            out[ours + "attention." + name] = tensor
    mlp = "mlp.shared_experts." if moe else "mlp."
    out[ours + mlp + "fc1.weight"] = hf_llama.swiglu_from_hf(hf_state[hf + mlp + "gate_proj.weight"],
                                                              hf_state[hf + mlp + "up_proj.weight"])
    out[ours + mlp + "fc2.weight"] = hf_state[hf + mlp + "down_proj.weight"]
    if moe:
        out[ours + "mlp.router.weight"] = hf_state[hf + "mlp.gate.weight"]
        bias = hf_state[hf + "mlp.gate.e_score_correction_bias"]
        if model.moe_router_enable_expert_bias:
            out[ours + "mlp.router.expert_bias"] = bias
        elif bias.any():
            raise ValueError(f"{hf}mlp.gate.e_score_correction_bias is not zero but topk_method is not 'noaux_tc' "
                             "(no expert bias): set topk_method to 'noaux_tc'")
        experts = [tuple(hf_state[f"{hf}mlp.experts.{e}.{proj}.weight"] for proj in _PROJS)
                   for e in range(model.num_experts)]
        out[ours + "mlp.experts.weight1"], out[ours + "mlp.experts.weight2"] = experts_from_hf(experts)
    return out


def from_hf_state(hf: dict[str, torch.Tensor], model: ModelConfig, padded_vocab_size: int,
                  rope_interleave: bool = True) -> dict[str, torch.Tensor]:
    """Our full state (vocabulary zero-padded to ``padded_vocab_size``) of HF DeepSeek-V3 tensors
    (``rope_interleave``: the config's flag, DeepSeek-V3's default)."""
    hf = {k: v for k, v in hf.items() if not k.endswith("rotary_emb.inv_freq")}
    scales = sorted(k for k in hf if k.endswith("weight_scale_inv"))
    if scales:  # DeepSeek publishes V3 in FP8 blocks with their scales
        raise ValueError(f"{scales[0]}: an FP8 block-quantized checkpoint; dequantize it to bf16 first (DeepSeek's "
                         "inference/fp8_cast_bf16.py)")
    expected = set(to_hf_state(_zeros_like_ours(hf, model), model, hf["model.embed_tokens.weight"].shape[0]))
    unknown, missing = sorted(set(hf) - expected), sorted(expected - set(hf))
    if unknown or missing:
        which, name = ("unexpected", unknown[0]) if unknown else ("missing", missing[0])
        raise KeyError(f"{which} tensor {name!r} in a DeepSeek-V3 checkpoint of this config.json")
    full = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
            "final_layernorm.weight": hf["model.norm.weight"]}
    if model.untie_embeddings_and_output_weights:
        full["output_layer.weight"] = hf["lm_head.weight"]
    head = hf.get("lm_head.weight", hf["model.embed_tokens.weight"])
    for layer in range(model.num_layers):
        full |= _layer_from_hf(hf, f"model.layers.{layer}.", f"layers.{layer}.", model, model.is_moe_layer(layer),
                               rope_interleave)
    for depth in range(model.mtp_num_layers or 0):
        layer = model.num_layers + depth
        ours, prefix = f"mtp.layers.{depth}.", f"model.layers.{layer}."
        copies = (("embed_tokens.weight", hf["model.embed_tokens.weight"]), ("shared_head.head.weight", head))
        for copy, shared in copies:
            if not torch.equal(hf[prefix + copy], shared):
                raise ValueError(f"{prefix + copy} differs from the model's own: our MTP depths share the model's "
                                 "word embedding and output layer")
        full |= {ours + name: hf[prefix + hf_name] for name, hf_name in _MTP.items()}
        full |= _layer_from_hf(hf, prefix, ours + "transformer_layer.0.", model, model.is_moe_layer(layer),
                               rope_interleave)
    return finish_full_state(full, model, padded_vocab_size)


def _zeros_like_ours(hf: dict[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """A stand-in full state with the names and shapes :func:`to_hf_state` reads, on the meta device (to list the HF
    names a checkpoint of ``model`` holds without allocating it)."""
    from megatron_like.model import GPTModel
    from megatron_like.parallel_state import ParallelState

    vocab = hf["model.embed_tokens.weight"].shape[0]
    with torch.device("meta"):
        built = GPTModel(model, ParallelState.single_process(torch.device("meta")), vocab_size=vocab, seed=0)
    return built.state_dict()
