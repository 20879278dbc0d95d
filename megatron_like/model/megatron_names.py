"""Our full state <-> Megatron-core's ``GPTModel`` names and fused layouts (docs/checkpoints.md, "Megatron-LM
checkpoints"). Read from megatron-core 0.16.1's code (``transformer/transformer_block.py``, ``transformer/mlp.py``,
``transformer/moe/experts.py``); ``tests/unit/test_megatron_names.py`` writes the key lists down.

A *full state* is ``megatron_like.model.state``'s (single-process names, global layer indices). A *Megatron
global state* is what Megatron-core's ``sharded_state_dict`` describes for the whole model: the tensors its
``torch_dist`` checkpoints hold, each under its sharded key with its global shape:

=============================================  =====================================================================
ours                                           Megatron-core
=============================================  =====================================================================
``embedding.word_embeddings.weight [V, h]``    the same name
``embedding.position_embeddings.weight``       the same name (learned absolute positions)
``layers.<i>.ln1.{weight,bias}``               ``...self_attention.linear_qkv.layer_norm_{weight,bias}``; the
                                               local spec's legacy files: ``decoder.layers.<i>.input_layernorm.*``
``layers.<i>.attention.qkv.{weight,bias}``     ``...self_attention.linear_qkv.*``: the same rows, grouped per query
                                               group ``[groups, heads/groups + 2, head_dim]`` on both sides
``layers.<i>.attention.proj.*``                ``...self_attention.linear_proj.*``
``layers.<i>.attention.{q,k}_layernorm.*``     ``...self_attention.{q,k}_layernorm.*`` (``--qk-layernorm``, Qwen3)
``layers.<i>.ln2.*``                           ``...mlp.linear_fc1.layer_norm_*``; ``...pre_mlp_layernorm.*`` in
                                               the local spec's legacy files and the TE spec's MoE layers
``layers.<i>.mlp.fc1.*``                       ``...mlp.linear_fc1.*``; SwiGLU: ours interleaves rows (2j gate j,
                                               2j+1 up j), Megatron-core holds all gate rows, then all up rows
``layers.<i>.mlp.fc2.*``                       ``...mlp.linear_fc2.*``
``layers.<i>.mlp.router.weight [E, h]``        ``...mlp.router.weight``
``layers.<i>.mlp.experts.weight1 [E, h, F1]``  ``...mlp.experts.experts.linear_fc1.weight [E, F1, h]`` (transposed;
                                               gate rows then up rows per expert)
``layers.<i>.mlp.experts.weight2 [E, F, h]``   ``...mlp.experts.experts.linear_fc2.weight [E, h, F]`` (transposed)
``layers.<i>.mlp.shared_experts.fc1/fc2``      ``...mlp.shared_experts.linear_fc1/linear_fc2`` (fc1 as above)
``final_layernorm.*``                          ``decoder.final_layernorm.*``
``output_layer.weight``                        the same name (untied only)
=============================================  =====================================================================

Uniform models (every layer alike: dense, or MoE with ``--moe-layer-freq 1``) are *stacked*: Megatron-core's
``TransformerBlock`` drops the layer index and prepends a ``[L]`` axis (``decoder.layers.mlp.linear_fc1.weight
[L, 2F, h]``, experts ``[L, E, ...]``); otherwise (``moe_layer_freq`` > 1 or a list) each layer keeps its index.
"""

from __future__ import annotations

import re

import torch

from megatron_like.config import ModelConfig
from megatron_like.model.multi_latent_attention import reorder_rope_rows

SPECS = ("local", "te")
"""Megatron-core's layer specs: ``local`` (``get_gpt_layer_local_spec``: separate norm modules) and ``te``
(``get_gpt_layer_with_transformer_engine_spec``: norms fused into the next linear)."""
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
MEGATRON_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
"""A per-layer Megatron-core name: (layer index, the rest)."""
_TOP = {"embedding.word_embeddings.weight": "embedding.word_embeddings.weight",
        "embedding.position_embeddings.weight": "embedding.position_embeddings.weight",
        "final_layernorm.weight": "decoder.final_layernorm.weight",
        "final_layernorm.bias": "decoder.final_layernorm.bias", "output_layer.weight": "output_layer.weight"}
_PLAIN = {"attention.qkv.weight": "self_attention.linear_qkv.weight",
          "attention.qkv.bias": "self_attention.linear_qkv.bias",
          "attention.proj.weight": "self_attention.linear_proj.weight",
          "attention.q_layernorm.weight": "self_attention.q_layernorm.weight",
          "attention.q_layernorm.bias": "self_attention.q_layernorm.bias",
          "attention.k_layernorm.weight": "self_attention.k_layernorm.weight",
          "attention.k_layernorm.bias": "self_attention.k_layernorm.bias",
          "attention.proj.bias": "self_attention.linear_proj.bias",
          "mlp.fc2.weight": "mlp.linear_fc2.weight", "mlp.fc2.bias": "mlp.linear_fc2.bias",
          "mlp.router.weight": "mlp.router.weight",
          "mlp.shared_experts.fc2.weight": "mlp.shared_experts.linear_fc2.weight",
          "mlp.shared_experts.fc2.bias": "mlp.shared_experts.linear_fc2.bias"}
_MLA = {"attention.q_proj.weight": "self_attention.linear_q_proj.weight",
        "attention.q_down.weight": "self_attention.linear_q_down_proj.weight",
        "attention.q_up.weight": "self_attention.linear_q_up_proj.weight",
        "attention.kv_down.weight": "self_attention.linear_kv_down_proj.weight",
        "attention.kv_up.weight": "self_attention.linear_kv_up_proj.weight",
        "mlp.router.expert_bias": "mlp.router.expert_bias"}
"""Multi-latent attention (``transformer/multi_latent_attention.py`` ``MLASelfAttention``) and the router's
persistent ``expert_bias`` buffer (``transformer/moe/router.py``)."""
_ROPE_ROWS = {"attention.q_proj.weight": "heads", "attention.q_up.weight": "heads", "attention.kv_down.weight": 1}
"""MLA weights whose rope rows Megatron-core keeps as DeepSeek's interleaved pairs (``models/common/embeddings/
rope_utils.py``: with ``multi_latent_attention`` it takes ``t[0::2]``, ``t[1::2]`` as the halves), per head."""
MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
"""A multi-token prediction depth's name, ours and Megatron-core's (``transformer/multi_token_prediction.py``):
``enorm``, ``hnorm``, ``eh_proj`` (``[h, 2h]``, embedding then hidden columns on both sides), ``final_layernorm``
and its ``transformer_layer`` (``.0.`` here: a one-layer list)."""
_GATE_UP = {"mlp.fc1.weight": "mlp.linear_fc1.weight", "mlp.fc1.bias": "mlp.linear_fc1.bias",
            "mlp.shared_experts.fc1.weight": "mlp.shared_experts.linear_fc1.weight",
            "mlp.shared_experts.fc1.bias": "mlp.shared_experts.linear_fc1.bias"}
"""SwiGLU linears: our interleaved rows <-> Megatron-core's gate block then up block."""
_MTP_TRANSFORMER = "transformer_layer.0."
EXPERT_FC1, EXPERT_FC2 = "mlp.experts.experts.linear_fc1.weight", "mlp.experts.experts.linear_fc2.weight"
_EXPERTS = {"mlp.experts.weight1": EXPERT_FC1, "mlp.experts.weight2": EXPERT_FC2}


def is_stacked(model: ModelConfig) -> bool:
    """Whether Megatron-core stacks the layers of ``model`` into ``[L, ...]`` tensors (its ``TransformerBlock``
    does unless ``moe_layer_freq`` is an int > 1 or a list)."""
    return model.num_experts is None or model.moe_layer_freq.strip() == "1"


def _norm_names(model: ModelConfig, layer: int, spec: str, sharded: bool) -> dict[str, str]:
    """Ours -> Megatron-core for the two per-layer norms of ``layer`` under layer spec ``spec``: module names
    (``sharded=False``, the legacy files) or sharded keys (torch_dist). The local spec's
    ``sharded_state_dict_keys_map`` renames its ``input_layernorm.`` / ``pre_mlp_layernorm.`` to the fused
    ``self_attention.linear_qkv.layer_norm_`` / ``mlp.linear_fc1.layer_norm_`` (MoE layers too); the TE spec fuses
    both norms into the next linear, except an MoE layer's separate ``pre_mlp_layernorm``."""
    if spec not in SPECS:
        raise ValueError(f"layer spec {spec!r} is not one of {SPECS}")
    moe = model.num_experts is not None and model.is_moe_layer(layer)
    if model.multi_latent_attention:
        return _mla_norm_names(spec, moe)
    fused_ln1 = spec == "te" or sharded
    fused_ln2 = (spec == "te" and not moe) or (spec == "local" and sharded)
    ln1 = "self_attention.linear_qkv.layer_norm_" if fused_ln1 else "input_layernorm."
    ln2 = "mlp.linear_fc1.layer_norm_" if fused_ln2 else "pre_mlp_layernorm."
    return {f"ln1.{kind}": f"{ln1}{kind}" for kind in ("weight", "bias")} | {
        f"ln2.{kind}": f"{ln2}{kind}" for kind in ("weight", "bias")}


def _mla_norm_names(spec: str, moe: bool) -> dict[str, str]:
    """The norms of an MLA layer (``models/gpt/gpt_layer_specs.py``, ``multi_latent_attention``): a separate
    ``input_layernorm`` in both specs and no ``sharded_state_dict_keys_map``; the latents' norms ``q_layernorm`` /
    ``kv_layernorm`` (local) or fused into the up-projections (TE); ``pre_mlp_layernorm`` except a TE dense layer's,
    fused into ``linear_fc1``."""
    te = spec == "te"
    ln2 = "mlp.linear_fc1.layer_norm_" if te and not moe else "pre_mlp_layernorm."
    names = {f"ln1.{kind}": f"input_layernorm.{kind}" for kind in ("weight", "bias")}
    names |= {f"ln2.{kind}": f"{ln2}{kind}" for kind in ("weight", "bias")}
    for ours, up, norm in (("q_norm", "linear_q_up_proj", "q_layernorm"), ("kv_norm", "linear_kv_up_proj",
                                                                           "kv_layernorm")):
        names[f"attention.{ours}.weight"] = f"self_attention.{up}.layer_norm_weight" if te else \
            f"self_attention.{norm}.weight"
    return names


def _rope_heads(rest: str, model: ModelConfig) -> int | None:
    heads = _ROPE_ROWS.get(rest) if model.multi_latent_attention else None
    return model.num_attention_heads if heads == "heads" else heads


def interleaved_to_gate_up(tensor: torch.Tensor) -> torch.Tensor:
    """Our SwiGLU rows ``[2F, ...]`` (row 2j gate j, 2j+1 up j) -> Megatron-core's ``[gate F; up F]``."""
    pairs = tensor.reshape(-1, 2, *tensor.shape[1:])
    return torch.cat([pairs[:, 0], pairs[:, 1]])


def gate_up_to_interleaved(tensor: torch.Tensor) -> torch.Tensor:
    """Megatron-core's ``[gate F; up F]`` rows -> ours, interleaved (inverse of :func:`interleaved_to_gate_up`)."""
    gate, up = tensor.chunk(2)
    return torch.stack([gate, up], dim=1).reshape(tensor.shape)


def _layer_to_megatron(rest: str, tensor: torch.Tensor, model: ModelConfig, names: dict[str, str]
                       ) -> tuple[str, torch.Tensor]:
    if rest in names:
        return names[rest], tensor
    if rest in _MLA:
        heads = _rope_heads(rest, model)
        rows = tensor if heads is None else reorder_rope_rows(tensor, heads, model.qk_pos_emb_head_dim, to_ours=False)
        return _MLA[rest], rows
    if rest in _PLAIN:
        return _PLAIN[rest], tensor
    if rest in _GATE_UP:
        return _GATE_UP[rest], interleaved_to_gate_up(tensor) if model.swiglu else tensor
    if rest == "mlp.experts.weight1":  # [E, h, F1] -> [E, F1, h], gate block then up block per expert
        rows = tensor.transpose(1, 2)
        return EXPERT_FC1, torch.stack([interleaved_to_gate_up(e) for e in rows]) if model.swiglu else rows
    if rest == "mlp.experts.weight2":
        return EXPERT_FC2, tensor.transpose(1, 2)
    raise KeyError(f"parameter layers.*.{rest} has no Megatron-core name (not a GPT parameter of this codebase)")


def to_megatron_layers(full: dict[str, torch.Tensor], model: ModelConfig, spec: str = "local", *,
                       sharded: bool) -> dict[str, torch.Tensor]:
    """Megatron-core's tensors of our full state with per-layer names (``decoder.layers.<i>.``), contiguous:
    its sharded keys (``sharded``, torch_dist) or its modules' state-dict names (legacy files)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in full.items():
        match, mtp = _LAYER.match(name), MTP_LAYER.match(name)
        if mtp is not None:
            depth, rest = int(mtp.group(1)), mtp.group(2)
            if rest.startswith(_MTP_TRANSFORMER):  # the depth's layer: named as the decoder layer L + depth
                layer, rest = model.num_layers + depth, rest[len(_MTP_TRANSFORMER):]
                key, tensor = _layer_to_megatron(rest, tensor, model, _norm_names(model, layer, spec, sharded))
                rest = "transformer_layer." + key
            out[f"mtp.layers.{depth}.{rest}"] = tensor
        elif match is None:
            if name not in _TOP:
                raise KeyError(f"parameter {name} has no Megatron-core name")
            out[_TOP[name]] = tensor
        else:
            layer = int(match.group(1))
            key, value = _layer_to_megatron(match.group(2), tensor, model, _norm_names(model, layer, spec, sharded))
            out[f"decoder.layers.{layer}.{key}"] = value
    return {k: v.contiguous() for k, v in out.items()}


def from_megatron_layers(mstate: dict[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """Our full state of Megatron-core tensors with per-layer names (either layer spec; inverse of
    :func:`to_megatron_layers`)."""
    top = {v: k for k, v in _TOP.items()}
    full: dict[str, torch.Tensor] = {}
    for name, tensor in mstate.items():
        match, mtp = MEGATRON_LAYER.match(name), MTP_LAYER.match(name)
        if mtp is not None:
            depth, rest = int(mtp.group(1)), mtp.group(2)
            if rest.startswith("transformer_layer."):
                ours, tensor = _layer_from_megatron(model.num_layers + depth, rest[len("transformer_layer."):],
                                                    tensor, model, name)
                rest = _MTP_TRANSFORMER + ours
            full[f"mtp.layers.{depth}.{rest}"] = tensor
        elif match is None:
            if name not in top:
                raise KeyError(f"Megatron-core tensor {name} has no counterpart here")
            full[top[name]] = tensor
        else:
            layer = int(match.group(1))
            ours, tensor = _layer_from_megatron(layer, match.group(2), tensor, model, name)
            full[f"layers.{layer}.{ours}"] = tensor
    return {k: v.contiguous() for k, v in full.items()}


def _layer_from_megatron(layer: int, rest: str, tensor: torch.Tensor, model: ModelConfig, name: str
                         ) -> tuple[str, torch.Tensor]:
    """(our name within layer ``layer``, our tensor) of Megatron-core's ``<rest>`` of that layer (either spec)."""
    norms = {v: k for spec in SPECS for sharded in (False, True)
             for k, v in _norm_names(model, layer, spec, sharded).items()}
    plain = {v: k for k, v in _PLAIN.items()} | {v: k for k, v in _EXPERTS.items()}
    gate_up = {v: k for k, v in _GATE_UP.items()}
    mla = {v: k for k, v in _MLA.items()}
    if rest in norms:
        return norms[rest], tensor
    if rest in gate_up:
        return gate_up[rest], gate_up_to_interleaved(tensor) if model.swiglu else tensor
    if rest == EXPERT_FC1:
        rows = torch.stack([gate_up_to_interleaved(e) for e in tensor]) if model.swiglu else tensor
        return "mlp.experts.weight1", rows.transpose(1, 2)
    if rest == EXPERT_FC2:
        return "mlp.experts.weight2", tensor.transpose(1, 2)
    if rest in mla:
        heads = _rope_heads(mla[rest], model)
        rows = tensor if heads is None else reorder_rope_rows(tensor, heads, model.qk_pos_emb_head_dim, to_ours=True)
        return mla[rest], rows
    if rest in plain:
        return plain[rest], tensor
    raise KeyError(f"Megatron-core tensor {name} has no counterpart here")


def stack_layers(mstate: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """Per-layer Megatron-core names -> the stacked ``decoder.layers.<rest> [L, ...]`` of a uniform model."""
    out: dict[str, torch.Tensor] = {}
    rests: dict[str, list[torch.Tensor | None]] = {}
    for name, tensor in mstate.items():
        match = MEGATRON_LAYER.match(name)
        if match is None:
            out[name] = tensor
            continue
        rests.setdefault(match.group(2), [None] * num_layers)[int(match.group(1))] = tensor
    for rest, layers in rests.items():
        if any(t is None for t in layers):
            raise ValueError(f"decoder.layers.*.{rest} is not in every layer: the model is not uniform")
        out[f"decoder.layers.{rest}"] = torch.stack(layers)
    return out


def unstack_layers(mstate: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stacked ``decoder.layers.<rest> [L, ...]`` -> per-layer names; per-layer keys pass unchanged."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in mstate.items():
        if name.startswith("decoder.layers.") and not MEGATRON_LAYER.match(name):
            rest = name[len("decoder.layers."):]
            out.update({f"decoder.layers.{i}.{rest}": t for i, t in enumerate(tensor.unbind(0))})
        else:
            out[name] = tensor
    return out


def to_megatron_global(full: dict[str, torch.Tensor], model: ModelConfig, spec: str = "local"
                       ) -> dict[str, torch.Tensor]:
    """Megatron-core's global state (its ``torch_dist`` keys and shapes) of our full state."""
    per_layer = to_megatron_layers(full, model, spec, sharded=True)
    return stack_layers(per_layer, model.num_layers) if is_stacked(model) else per_layer


def from_megatron_global(mstate: dict[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """Our full state of Megatron-core's global state (stacked or per-layer keys, either spec)."""
    return from_megatron_layers(unstack_layers(mstate), model)


# ---------------------------------------------------------------- tensor parallelism of Megatron-core's names

_COLUMN = ("embedding.word_embeddings.weight", "output_layer.weight", "linear_qkv.weight", "linear_qkv.bias",
           "linear_fc1.weight", "linear_fc1.bias", "linear_q_proj.weight", "linear_q_up_proj.weight",
           "linear_kv_up_proj.weight", "eh_proj.weight")
_LOCAL_COLUMN = ("linear_q_down_proj.weight", "linear_kv_down_proj.weight")
"""MLA's down-projections: ColumnParallelLinear (``gather_output=False``) in the local spec, TE's duplicated
``TELinear`` in the TE spec (``transformer/multi_latent_attention.py``)."""
_ROW = ("linear_proj.weight", "linear_fc2.weight")


def megatron_tp_dim(name: str, spec: str = "local") -> int | None:
    """The dimension Megatron-core's layer spec ``spec`` splits the per-layer tensor ``name`` along over tp (None:
    replicated). Expert tensors ``[E, ...]`` count their expert axis."""
    expert = 1 if name.endswith((EXPERT_FC1, EXPERT_FC2)) else 0
    if (name.endswith(_COLUMN) or spec == "local" and name.endswith(_LOCAL_COLUMN)) and "layer_norm" not in name:
        return expert
    if name.endswith(_ROW):
        return 1 + expert
    return None


def _is_gate_up(name: str, model: ModelConfig) -> bool:
    return model.swiglu and name.endswith(("linear_fc1.weight", "linear_fc1.bias"))


def split_tp_megatron(name: str, tensor: torch.Tensor, model: ModelConfig, tp: int, rank: int,
                      spec: str = "local") -> torch.Tensor:
    """Tp rank ``rank``'s tensor of the per-layer Megatron-core tensor ``name``, as Megatron-core holds it: a
    SwiGLU fc1 rank holds its gate rows then its up rows (``[gate_r; up_r]``), not a slice of ``[gate; up]``."""
    dim = megatron_tp_dim(name, spec)
    if dim is None or tp == 1:
        return tensor
    if _is_gate_up(name, model):
        return torch.cat([half.chunk(tp, dim)[rank] for half in tensor.chunk(2, dim)], dim).clone()
    return tensor.chunk(tp, dim)[rank].clone()


def merge_tp_megatron(name: str, shards: list[torch.Tensor], model: ModelConfig, spec: str = "local"
                      ) -> torch.Tensor:
    """The whole tensor ``name`` of Megatron-core's tp-rank tensors (inverse of :func:`split_tp_megatron`)."""
    dim = megatron_tp_dim(name, spec)
    if dim is None or len(shards) == 1:
        return shards[0]
    if _is_gate_up(name, model):
        halves = [s.chunk(2, dim) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim)
    return torch.cat(shards, dim)
