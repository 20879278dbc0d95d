"""Megatron-LM's own checkpoint files: its legacy ``torch`` format and Megatron-core's ``torch_dist``, read and
written from our full state (docs/checkpoints.md, "Megatron-LM checkpoints"). Names and fused layouts are
``megatron_like.model.megatron_names``'; this module knows the files::

    DIR/latest_checkpointed_iteration.txt
    DIR/iter_0000100/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt   legacy: _PPP only when pp > 1, _EEE when ep > 1;
                                                                  {"args", "checkpoint_version", "iteration",
                                                                   "model" (or "model0", "model1", ...), ...}
    DIR/iter_0000100/metadata.json, .metadata, __R_0.distcp        torch_dist: Megatron-core's sharded keys
    DIR/iter_0000100/common.pt                                    torch_dist: {"args", "checkpoint_version", ...}

``args`` is an ``argparse.Namespace``: read with torch's weights-only unpickler allowing exactly that class (and
stand-ins for the few Megatron-core enums it holds), never with plain pickle.
"""

from __future__ import annotations

import argparse
import enum
import json
import os
import typing
from typing import Any

import numpy as np
import torch

try:  # numpy's array constructor, which pickles of arrays name: numpy 2's module, or numpy 1's
    from numpy._core.multiarray import _reconstruct
except ImportError:
    from numpy.core.multiarray import _reconstruct

from megatron_like.config import Config, ModelConfig
from megatron_like.model import megatron_names as names
from megatron_like.model.gpt import chunk_layers
from megatron_like.training import checkpointing as ckpt
from megatron_like.training.checkpoint_validation import read_checkpoint_file
from megatron_like.training.megatron_legacy_optim import optimizer_entry, param_group, read_optimizer_entry

CHECKPOINT_VERSION = 3.0
"""Megatron-LM's ``checkpoint_version`` of the current layout (QKV grouped per query group)."""
FILE = "model_optim_rng.pt"
METADATA_JSON = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                 "common_backend_version": 1}
"""Megatron-core's ``metadata.json`` (``dist_checkpointing/core.py``'s CheckpointingConfig) of torch_dist."""
EXPERT_STYLES = ("grouped", "sequential")
"""How Megatron-core's legacy files hold experts: GroupedMLP (``--moe-grouped-gemm``: ``mlp.experts.weight1/2``)
or SequentialMLP (``mlp.experts.local_experts.<e>.linear_fc1/2.weight``). torch_dist keys are the same for both."""
MODEL_FIELDS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "seq_length", "max_position_embeddings",
    "make_vocab_size_divisible_by", "hidden_dropout", "attention_dropout", "init_method_std", "norm_epsilon",
    "untie_embeddings_and_output_weights", "position_embedding_type", "rotary_base", "rotary_percent",
    "rotary_seq_len_interpolation_factor", "use_rope_scaling", "rope_scaling_factor", "normalization", "swiglu",
    "group_query_attention", "num_query_groups", "add_qkv_bias", "num_experts", "moe_router_topk",
    "moe_ffn_hidden_size", "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff",
    "moe_router_pre_softmax", "moe_expert_capacity_factor", "moe_shared_expert_intermediate_size", "kv_channels",
    "qk_layernorm") + (
    "moe_router_score_function", "moe_router_num_groups", "moe_router_group_topk", "moe_router_topk_scaling_factor",
    "moe_router_enable_expert_bias", "moe_router_bias_update_rate", "mtp_num_layers", "mtp_loss_scaling_factor")
"""ModelConfig fields stored under the same name and meaning in Megatron-LM's ``args``."""
MLA_FIELDS = ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
              "v_head_dim", "rope_type", "mscale", "mscale_all_dim", "rotary_scaling_factor",
              "original_max_position_embeddings", "beta_fast", "beta_slow")
"""Multi-latent attention's fields (Megatron-core's ``MLATransformerConfig`` names), read only when it is on."""
RUN_FIELDS = {"training": ("micro_batch_size", "global_batch_size", "train_iters", "seed"),
              "optimizer": ("lr", "min_lr", "lr_decay_style", "lr_decay_iters", "lr_warmup_iters", "lr_warmup_fraction",
                            "weight_decay", "clip_grad", "adam_beta1", "adam_beta2", "adam_eps")}
"""Training and optimizer fields stored under the same name and meaning in Megatron-LM's ``args``."""
SHARDING_TYPE = "fully_sharded_model_space"
"""Megatron-core's ``param_state_sharding_type`` whose keys are ``optimizer.state.<kind>.<model key>`` with the
model tensor's global shape (``DistributedOptimizer.sharded_param_state_fs_model_space``); written here."""
OPTIMIZER_KINDS = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "master": "fp32_param"}
"""Our optimizer state kind (``optimizer.<kind>.<name>``) -> Megatron-core's (``optimizer.state.<kind>.<key>``).
Its ``fully_reshardable`` type names the masters ``param``: read as well."""


class _MegatronEnum:
    """Stand-in for a Megatron-core enum member inside ``args`` (e.g. ``AttnBackend.auto``): keeps its value."""

    def __init__(self, value: Any) -> None:
        self.value = value


_ENUMS = ("megatron.core.transformer.enums.AttnBackend", "megatron.core.enums.ModelType",
          "megatron.core.transformer.enums.AttnMaskType", "megatron.core.enums.Fp8Recipe")
_NUMPY = [np.ndarray, np.dtype, np.dtypes.UInt32DType, (_reconstruct, "numpy.core.multiarray._reconstruct"),
          (_reconstruct, "numpy._core.multiarray._reconstruct")]
"""What numpy's generator state in Megatron-LM's ``rng_state`` (``np.random.get_state()``: a ``uint32`` array)
needs to unpickle: the array class, its dtype and numpy's array constructor (under numpy 1's module path too)."""


def safe_globals() -> list:
    """What Megatron-LM's ``args`` and ``rng_state`` need allowed in torch's weights-only unpickler, less what the
    process allows already (torch's context manager removes on exit what it was given: a global allowance, e.g.
    Megatron-core's, must survive our reads)."""
    present = torch.serialization.get_safe_globals()
    wanted = [argparse.Namespace] + [(_MegatronEnum, path) for path in _ENUMS] + _NUMPY
    return [g for g in wanted if g not in present]


def read_megatron_file(path: str, mmap: bool = False, verify: bool = True) -> dict[str, Any]:
    """A Megatron-LM ``model_optim_rng.pt`` or ``common.pt`` (weights-only with ``Namespace`` and numpy's generator
    state; ``mmap`` and ``verify``, the CRC check: as ``read_checkpoint_file``)."""
    with torch.serialization.safe_globals(safe_globals()):
        return read_checkpoint_file(path, mmap=mmap, verify=verify)


def legacy_dir_name(tp_rank: int, pp_rank: int, pp: int, ep_rank: int = 0, ep: int = 1) -> str:
    """Megatron-LM's ``mp_rank_TT`` (pp 1) or ``mp_rank_TT_PPP``, plus ``_EEE`` under expert parallelism."""
    return f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "") + (f"_{ep_rank:03d}" if ep > 1 else "")


# ---------------------------------------------------------------- RNG states


def rng_object_key(tp_rank: int, pp_rank: int, tp: int, pp: int) -> str:
    """The torch_dist key of the ``rng_state`` ShardedObject of rank (tp, pp): Megatron-LM's
    ``training/checkpointing.py`` ``get_rng_state`` shards it over ``(pp, tp)`` (every dp rank a replica)."""
    return f"rng_state/shard_{pp_rank}.{tp_rank}_{pp}.{tp}"


def rng_to_megatron(ours: dict[str, Any]) -> dict[str, Any]:
    """Megatron-LM's per-rank ``rng_state`` entry of ours (``checkpointing.rng_state``): python's, numpy's and
    torch's generators, the tracker's streams and, from a CUDA run, the CUDA generator."""
    state = {"random_rng_state": (3, tuple(ours["python"]), ours["python_pos"]),
             "np_rng_state": ("MT19937", ours["numpy_keys"].numpy().astype(np.uint32), int(ours["numpy_pos"]), 0, 0.0),
             "torch_rng_state": ours["torch"], "rng_tracker_states": dict(ours["tracker"])}
    if "cuda" in ours:
        state["cuda_rng_state"] = ours["cuda"]
    return state


def rng_from_megatron(state: dict[str, Any]) -> dict[str, Any]:
    """Ours (``checkpointing.set_rng_state``'s input) of one Megatron-LM ``rng_state`` entry (inverse of
    :func:`rng_to_megatron`; numpy's cached Gaussian is dropped, as ours never keeps one). Its tracker streams are
    CUDA ones when it holds a CUDA generator state."""
    _, python_keys, gauss_next = state["random_rng_state"]
    _, numpy_keys, numpy_pos, *_ = state["np_rng_state"]
    ours = {"python": list(python_keys), "python_pos": gauss_next,
            "numpy_keys": torch.from_numpy(np.asarray(numpy_keys).astype(np.int64)), "numpy_pos": int(numpy_pos),
            "torch": state["torch_rng_state"], "tracker": dict(state["rng_tracker_states"]),
            "tracker_device": "cuda" if "cuda_rng_state" in state else "cpu"}
    if "cuda_rng_state" in state:
        ours["cuda"] = state["cuda_rng_state"]
    return ours


# ---------------------------------------------------------------- arguments


def megatron_args(config: Config, padded_vocab: int, iteration: int, *, tp: int, pp: int, ep: int, spec: str,
                  ckpt_format: str, experts: str, consumed_samples: int = 0) -> argparse.Namespace:
    """The ``args`` Megatron-LM stores (and checks on load) for our config at the given layout."""
    m = config.model
    values: dict[str, Any] = {f: getattr(m, f) for f in MODEL_FIELDS + MLA_FIELDS}
    # Megatron-core's MLA normalizes its latents only with --qk-layernorm (else IdentityOp); ours always does
    values["qk_layernorm"] = m.qk_layernorm or m.multi_latent_attention
    values.update({f: getattr(getattr(config, group), f) for group, fields in RUN_FIELDS.items() for f in fields})
    values["global_batch_size"] = config.global_batch_size
    values.update(
        add_bias_linear=m.linear_bias, vocab_size=m.vocab_size, padded_vocab_size=padded_vocab,
        window_size=None if m.window_size is None else tuple(int(x) for x in m.window_size.split(",")),
        moe_layer_freq=_megatron_layer_freq(m), num_query_groups=m.query_groups if m.group_query_attention else None,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
        transformer_impl="transformer_engine" if spec == "te" else "local", ckpt_format=ckpt_format,
        use_dist_ckpt=ckpt_format == "torch_dist", moe_grouped_gemm=experts == "grouped", iteration=iteration,
        consumed_train_samples=consumed_samples, bf16=config.precision.bf16, fp16=config.precision.fp16,
        params_dtype=torch.bfloat16 if config.precision.bf16 else torch.float16 if config.precision.fp16
        else torch.float32, seed=config.training.seed, group_query_attention=m.group_query_attention)
    return argparse.Namespace(**values)


def _megatron_layer_freq(model: ModelConfig) -> int | list[int]:
    freq = model.moe_layer_freq.strip()
    return int(freq) if freq.isdigit() else [int(x) for x in model.moe_layer_pattern]


def model_config_from_args(args: argparse.Namespace) -> ModelConfig:
    """Our ModelConfig of a Megatron-LM checkpoint's ``args`` (the shared fields; the rest keep defaults)."""
    mla = bool(getattr(args, "multi_latent_attention", False))
    if mla and not getattr(args, "qk_layernorm", False):
        raise ValueError("--multi-latent-attention without --qk-layernorm (latents without norms) is not implemented "
                         "here (DeepSeek's MLA normalizes both latents)")
    fields = MODEL_FIELDS + (MLA_FIELDS if mla else ())
    values = {f: getattr(args, f) for f in fields if getattr(args, f, None) is not None}
    if mla:
        values.pop("qk_layernorm")  # ours: the latents' norms come with MLA
    values["disable_bias_linear"] = not getattr(args, "add_bias_linear", True)
    if not values.get("group_query_attention"):
        values.pop("num_query_groups", None)
    window = getattr(args, "window_size", None)
    if window is not None:
        values["window_size"] = ",".join(str(int(x)) for x in window)
    freq = getattr(args, "moe_layer_freq", 1)
    values["moe_layer_freq"] = str(freq) if isinstance(freq, int) else repr([int(x) for x in freq])
    for key, value in list(values.items()):
        if isinstance(value, (_MegatronEnum, enum.Enum)):
            values[key] = value.value
    _check_choices(values)
    return ModelConfig(**values)


def config_from_args(args: argparse.Namespace) -> Config:
    """Our Config of a Megatron-LM checkpoint's ``args``: the model (:func:`model_config_from_args`), its layout and
    the training and optimizer fields both codebases share (the rest keep our defaults)."""
    config = Config()
    config.model = model_config_from_args(args)
    for group, fields in RUN_FIELDS.items():
        section = getattr(config, group)
        for f in fields:
            value = getattr(args, f, None)
            try:
                _check_choices({f: value}, type(section))
            except ValueError:  # Megatron-LM's WSD schedule, ...: refused on resume, not when fine-tuning
                continue
            if value is not None:
                setattr(section, f, value)
    p = config.parallel
    p.tensor_model_parallel_size = args.tensor_model_parallel_size
    p.pipeline_model_parallel_size = args.pipeline_model_parallel_size
    p.expert_model_parallel_size = getattr(args, "expert_model_parallel_size", 1) or 1
    config.world_size = getattr(args, "world_size", None) or (
        p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.expert_model_parallel_size)
    config.model.vocab_size = getattr(args, "vocab_size", None) or config.model.vocab_size
    return config


def scheduler_from_megatron(state: dict[str, Any], global_batch_size: int) -> dict[str, Any]:
    """Our lr scheduler's state of Megatron-LM's ``opt_param_scheduler``, which counts samples where ours counts
    iterations (Megatron-LM steps it by the global batch size; its warmup and decay lengths are iterations times
    the global batch size)."""
    return {"num_steps": int(state["num_steps"]) // global_batch_size, "max_lr": state["max_lr"],
            "min_lr": state["min_lr"], "warmup_iters": int(state["lr_warmup_steps"]) // global_batch_size,
            "decay_iters": int(state["lr_decay_steps"]) // global_batch_size, "decay_style": state["lr_decay_style"]}


def scheduler_to_megatron(state: dict[str, Any], config: Config) -> dict[str, Any]:
    """Megatron-LM's ``opt_param_scheduler`` of our scheduler's state (inverse of :func:`scheduler_from_megatron`;
    weight decay constant, as ours)."""
    gbs, wd = config.global_batch_size, config.optimizer.weight_decay
    return {"max_lr": state["max_lr"], "min_lr": state["min_lr"], "lr_warmup_steps": state["warmup_iters"] * gbs,
            "num_steps": state["num_steps"] * gbs, "lr_decay_style": state["decay_style"],
            "lr_decay_steps": state["decay_iters"] * gbs, "start_wd": wd, "end_wd": wd, "wd_incr_style": "constant",
            "wd_incr_steps": config.training.train_iters * gbs}


def optimizer_common(step: float | None, config: Config) -> dict[str, Any]:
    """The ``optimizer`` entry of Megatron-core's ``common.pt`` for its distributed optimizer: torch's param group
    values (the step count in each, as native torch AdamW keeps it) and the sharding type of the saved state."""
    groups = []
    for wd_mult in (1.0, 0.0):  # Megatron-core's default groups: decayed weights; biases and norms without decay
        group = param_group(config, wd_mult)
        groups.append(group if step is None else {**group, "step": step})
    return {"optimizer": {"param_groups": groups}, "param_state_sharding_type": SHARDING_TYPE}


def optimizer_step_of(common: dict[str, Any]) -> float | None:
    """AdamW's step count of Megatron-core's ``optimizer`` common entry: the distributed optimizer's param groups
    (``step`` in each) or the plain optimizer's ``state.common_step``; None when it holds none."""
    inner = (common or {}).get("optimizer") or {}
    steps = {float(g["step"]) for g in inner.get("param_groups", []) if "step" in g}
    if "common_step" in inner.get("state", {}):
        steps.add(float(inner["state"]["common_step"]))
    if len(steps) > 1:
        raise ckpt.CheckpointError(f"the Megatron-LM optimizer holds several step counts {sorted(steps)}: only one "
                                   "shared by every parameter is read here")
    return steps.pop() if steps else None


def _check_choices(values: dict[str, Any], owner: type = ModelConfig) -> None:
    """Raise a one-line ValueError for a value outside its field's ``Literal`` choices (Megatron-LM has more:
    ``global_aux_loss``, ``flex``, ...); ``Config.validate`` leaves choices to the command-line parser."""
    hints = typing.get_type_hints(owner, include_extras=True)
    for key, value in values.items():
        hint = typing.get_args(hints[key])[0] if typing.get_origin(hints[key]) is typing.Annotated else hints[key]
        if typing.get_origin(hint) is typing.Literal and value not in typing.get_args(hint):
            choices = ", ".join(map(str, typing.get_args(hint)))
            raise ValueError(f"--{key.replace('_', '-')} {value} (from the checkpoint's args) is not implemented "
                             f"here (choices: {choices})")


# ---------------------------------------------------------------- legacy torch format


def _layer_extra_states(model: ModelConfig, spec: str, layer: int) -> list[str]:
    """``<rest>._extra_state`` entries of layer ``layer``: Megatron-core's linears (and TE's attention core) hold one
    each (None for the local spec's); its experts are not listed here."""
    attention = ["linear_qkv"] if not model.multi_latent_attention else [
        "linear_q_proj"] if model.q_lora_rank is None else ["linear_q_down_proj", "linear_q_up_proj"]
    if model.multi_latent_attention:
        attention += ["linear_kv_down_proj", "linear_kv_up_proj"]
    rests = [f"self_attention.{linear}._extra_state" for linear in attention + ["linear_proj"]]
    if spec == "te":
        rests.append("self_attention.core_attention._extra_state")
    if model.num_experts is None or not model.is_moe_layer(layer):
        rests += ["mlp.linear_fc1._extra_state", "mlp.linear_fc2._extra_state"]
    elif model.moe_shared_expert_intermediate_size:
        rests += ["mlp.shared_experts.linear_fc1._extra_state", "mlp.shared_experts.linear_fc2._extra_state"]
    return rests


def _experts_to_legacy(layer_prefix: str, fc1: torch.Tensor, fc2: torch.Tensor, style: str) -> dict[str, Any]:
    """One rank's experts ``fc1 [E_local, F1_r, h]``, ``fc2 [E_local, h, F_r]`` as Megatron-core's module holds
    them: GroupedMLP's ``weight1 [h, E_local * F1_r]`` is the ``[E_local, h, F1_r]`` memory viewed 2-D."""
    if style == "grouped":
        hidden = fc1.shape[-1]
        return {layer_prefix + "mlp.experts.weight1": fc1.transpose(1, 2).contiguous().reshape(hidden, -1),
                layer_prefix + "mlp.experts.weight2": fc2.transpose(1, 2).contiguous().reshape(-1, hidden)}
    out = {}
    for e in range(fc1.shape[0]):
        out[f"{layer_prefix}mlp.experts.local_experts.{e}.linear_fc1.weight"] = fc1[e].clone()
        out[f"{layer_prefix}mlp.experts.local_experts.{e}.linear_fc2.weight"] = fc2[e].clone()
    return out


def _sequential_experts(state: dict[str, Any], layer_prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
    """SequentialMLP's ``local_experts.<e>`` of one rank, stacked: ``(fc1 [E_local, F1_r, h], fc2 [E_local, h,
    F_r])``."""
    fc1, fc2, e = [], [], 0
    while f"{layer_prefix}mlp.experts.local_experts.{e}.linear_fc1.weight" in state:
        fc1.append(state[f"{layer_prefix}mlp.experts.local_experts.{e}.linear_fc1.weight"])
        fc2.append(state[f"{layer_prefix}mlp.experts.local_experts.{e}.linear_fc2.weight"])
        e += 1
    if not fc1:
        raise ckpt.CheckpointError(f"no experts under {layer_prefix}mlp.experts in the Megatron-LM checkpoint")
    return torch.stack(fc1), torch.stack(fc2)


_MODULE_ORDER = (
    "embedding.word_embeddings.", "embedding.position_embeddings.", "decoder.layers.", "decoder.final_layernorm.",
    "output_layer.")
_LAYER_ORDER = (
    "input_layernorm.", "self_attention.linear_proj.", "self_attention.linear_qkv.", "self_attention.linear_q_proj.",
    "self_attention.linear_q_down_proj.", "self_attention.linear_q_up_proj.", "self_attention.linear_kv_down_proj.",
    "self_attention.linear_kv_up_proj.", "self_attention.q_layernorm.", "self_attention.k_layernorm.",
    "self_attention.kv_layernorm.", "pre_mlp_layernorm.", "mlp.router.", "mlp.experts.", "mlp.shared_experts.",
    "mlp.linear_fc1.", "mlp.linear_fc2.")
"""Megatron-core's modules in their registration order (its ``named_parameters``' and state dict's): a layer's
attention builds ``linear_proj`` before ``linear_qkv`` (``Attention.__init__``, then ``SelfAttention``'s), an MoE
layer its router, experts, then shared experts; seen from its GPTModel of the local spec on CPU."""
_TENSOR_ORDER = ("layer_norm_weight", "layer_norm_bias", "weight", "bias", "expert_bias", "_extra_state")
"""Within one module: a TE linear's fused norm first (assumed from Transformer Engine's ``LayerNormLinear``, not
seen here), then its weight and bias, then buffers and extra state."""


def _position(name: str, order: tuple[str, ...]) -> int:
    return next((i for i, prefix in enumerate(order) if name.startswith(prefix)), len(order))


def module_order(name: str) -> tuple:
    """Sort key of a Megatron-core GPTModel state-dict name in its module order (``_MODULE_ORDER``)."""
    top = _position(name, _MODULE_ORDER)
    match = names.MEGATRON_LAYER.match(name)
    if match is None:
        return top, 0, 0, (), _TENSOR_ORDER.index(name.rsplit(".", 1)[1]) if "." in name else 0
    rest = match.group(2)
    module, _, tensor = rest.rpartition(".")
    numbers = tuple(int(part) for part in module.split(".") if part.isdigit())  # local_experts.<e>
    fc = 1 if module.endswith("linear_fc2") or tensor == "weight2" else 0
    kind = _TENSOR_ORDER.index(tensor) if tensor in _TENSOR_ORDER else 2
    return top, int(match.group(1)), _position(rest, _LAYER_ORDER), numbers + (fc,), kind


def legacy_rank_state(per_layer: dict[str, torch.Tensor], config: Config, *, tp: int, tp_rank: int, pp: int,
                      pp_rank: int, ep: int, ep_rank: int, spec: str, experts: str) -> dict[str, Any]:
    """The ``model`` state dict Megatron-core's GPTModel holds on rank (tp, pp, ep): its stage's layers under
    local indices, tensor-parallel slices, this ep rank's experts, ``_extra_state`` entries (None)."""
    m = config.model
    if m.mtp_num_layers:
        raise ValueError("Megatron-LM's legacy torch files are not written with multi-token prediction layers here: "
                         "use --ckpt-format torch_dist")
    layers = chunk_layers(m.num_layers, pp, pp_rank, 1, 0)
    first, last = pp_rank == 0, pp_rank == pp - 1
    out: dict[str, Any] = {}
    for name, tensor in per_layer.items():
        match = names.MEGATRON_LAYER.match(name)
        if match is None:
            if name.startswith("embedding.") and not first or not name.startswith("embedding.") and not last:
                continue
            out[name] = names.split_tp_megatron(name, tensor, m, tp, tp_rank, spec)
            continue
        layer, rest = int(match.group(1)), match.group(2)
        if layer not in layers:
            continue
        prefix = f"decoder.layers.{layer - layers[0]}."
        if rest == names.EXPERT_FC2:
            continue  # written with fc1 below
        if rest == names.EXPERT_FC1:
            fc1, fc2 = (per_layer[f"decoder.layers.{layer}.{k}"].chunk(ep)[ep_rank]
                        for k in (names.EXPERT_FC1, names.EXPERT_FC2))
            fc1 = names.split_tp_megatron(names.EXPERT_FC1, fc1, m, tp, tp_rank)
            fc2 = names.split_tp_megatron(names.EXPERT_FC2, fc2, m, tp, tp_rank)
            out.update(_experts_to_legacy(prefix, fc1, fc2, experts))
            continue
        out[prefix + rest] = names.split_tp_megatron(rest, tensor, m, tp, tp_rank, spec)
    for layer in layers:
        out.update({f"decoder.layers.{layer - layers[0]}.{rest}": None for rest in _layer_extra_states(m, spec, layer)})
    if last:  # the output layer's module exists on the last stage, tied or not
        out["output_layer._extra_state"] = None
    if last and first is False and not m.untie_embeddings_and_output_weights:
        # Megatron-LM's last stage holds its own copy of the tied embedding as the output layer's weight
        word = per_layer["embedding.word_embeddings.weight"]
        out["output_layer.weight"] = names.split_tp_megatron("output_layer.weight", word, m, tp, tp_rank)
    return dict(sorted(out.items(), key=lambda item: module_order(item[0])))


def save_legacy(root: str, iteration: int, config: Config, per_layer: dict[str, torch.Tensor], padded_vocab: int, *,
                tp: int, pp: int, ep: int, spec: str, experts: str, consumed_samples: int = 0,
                extra: dict[str, Any] | None = None, rng: dict[tuple[int, int], dict] | None = None,
                moments: dict[str, dict[str, torch.Tensor]] | None = None, step: float | None = None) -> None:
    """Write Megatron-LM's legacy torch format at layout tp x pp x ep; ``extra``: further entries of every file
    (``opt_param_scheduler``); ``rng``: Megatron-LM's ``rng_state`` entry of each (tp rank, pp rank);
    ``moments``: our optimizer kinds (``megatron_legacy_optim.KINDS``) in ``per_layer``'s names, written as each
    rank's ``optimizer`` entry with AdamW's ``step``."""
    args = megatron_args(config, padded_vocab, iteration, tp=tp, pp=pp, ep=ep, spec=spec, ckpt_format="torch",
                         experts=experts, consumed_samples=consumed_samples)
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            for ep_rank in range(ep):
                state = legacy_rank_state(per_layer, config, tp=tp, tp_rank=tp_rank, pp=pp, pp_rank=pp_rank, ep=ep,
                                          ep_rank=ep_rank, spec=spec, experts=experts)
                path = os.path.join(root, f"iter_{iteration:07d}", legacy_dir_name(tp_rank, pp_rank, pp, ep_rank, ep))
                os.makedirs(path, exist_ok=True)
                entries = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
                           "model": state, "num_floating_point_operations_so_far": 0, **(extra or {})}
                if rng is not None:  # one item: every dp rank's generators are the same (no data_parallel_random_init)
                    entries["rng_state"] = [rng[tp_rank, pp_rank]]
                if moments:
                    rank_moments = {kind: legacy_rank_state(part, config, tp=tp, tp_rank=tp_rank, pp=pp,
                                                            pp_rank=pp_rank, ep=ep, ep_rank=ep_rank, spec=spec,
                                                            experts=experts) for kind, part in moments.items()}
                    entries["optimizer"] = optimizer_entry(state, rank_moments, step or 0.0, config, ep)
                ckpt.save_atomically(os.path.join(path, FILE), entries)
    ckpt.write_tracker(root, iteration)


def load_legacy(it_dir: str, args: argparse.Namespace, model: ModelConfig, with_optimizer: bool = False
                ) -> tuple[dict[str, dict[str, torch.Tensor]], float | None]:
    """({"model": Megatron-core per-layer global tensors (``to_megatron_layers``' form)} and, ``with_optimizer``,
    our optimizer kinds under the same names, AdamW's step count or None) of a legacy checkpoint directory."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    ep = getattr(args, "expert_model_parallel_size", 1) or 1
    spec = "te" if getattr(args, "transformer_impl", "local") == "transformer_engine" else "local"
    if getattr(args, "virtual_pipeline_model_parallel_size", None):
        raise ckpt.CheckpointError(f"{it_dir} was saved with virtual pipeline stages (model0, model1, ...): not "
                                   "read here; convert it to torch_dist with Megatron-LM first")
    out: dict[str, dict[str, torch.Tensor]] = {}
    steps: set[float] = set()
    for pp_rank in range(pp):
        layers = chunk_layers(model.num_layers, pp, pp_rank, 1, 0)
        parts: dict[str, list[list[dict[str, Any]]]] = {}
        for t in range(tp):
            for e in range(ep):
                path = os.path.join(it_dir, legacy_dir_name(t, pp_rank, pp, e, ep), FILE)
                saved = read_megatron_file(path)
                kinds = {"model": saved["model"]}
                if with_optimizer and saved.get("optimizer") is not None:  # --no-save-optim: none
                    moments, step = read_optimizer_entry(saved["model"], saved["optimizer"], path)
                    kinds.update(moments)
                    steps.update([] if step is None else [step])
                for kind, state in kinds.items():
                    parts.setdefault(kind, [[] for _ in range(tp)])[t].append(state)
        for kind, ranks in parts.items():
            _merge_legacy_stage(ranks, layers, model, spec, tp, out.setdefault(kind, {}))
    if len(steps) > 1:
        raise ckpt.CheckpointError(f"{it_dir}: the Megatron-LM optimizer holds several step counts {sorted(steps)}")
    return out, steps.pop() if steps else None


def _merge_legacy_stage(ranks: list[list[dict[str, Any]]], layers: list[int], model: ModelConfig, spec: str,
                        tp: int, out: dict[str, torch.Tensor]) -> None:
    """Merge one pipeline stage's ``ranks[tp rank][ep rank]`` state dicts (model or one optimizer kind) into ``out``
    under global layer indices (in place)."""
    first = ranks[0][0]
    for name in first:
        if name.endswith("_extra_state") or ".mlp.experts." in name or not isinstance(first[name], torch.Tensor):
            continue
        if name == "output_layer.weight" and not model.untie_embeddings_and_output_weights:
            continue  # the last stage's copy of the tied embedding
        merged = names.merge_tp_megatron(name, [r[0][name] for r in ranks], model, spec)
        match = names.MEGATRON_LAYER.match(name)
        out[f"decoder.layers.{layers[int(match.group(1))]}.{match.group(2)}" if match else name] = merged
    for local, layer in enumerate(layers):
        if model.num_experts is None or not model.is_moe_layer(layer):
            continue
        prefix = f"decoder.layers.{local}."
        fc1s, fc2s = [], []
        for t in range(tp):
            per_ep = [_legacy_experts(r, prefix, model, tp) for r in ranks[t]]
            fc1s.append(torch.cat([p[0] for p in per_ep]))
            fc2s.append(torch.cat([p[1] for p in per_ep]))
        out[f"decoder.layers.{layer}.{names.EXPERT_FC1}"] = names.merge_tp_megatron(names.EXPERT_FC1, fc1s, model)
        out[f"decoder.layers.{layer}.{names.EXPERT_FC2}"] = names.merge_tp_megatron(names.EXPERT_FC2, fc2s, model)


def _legacy_experts(state: dict[str, Any], prefix: str, model: ModelConfig, tp: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's ``(fc1 [E_local, F1_r, h], fc2 [E_local, h, F_r])`` from either expert style."""
    w1 = state.get(prefix + "mlp.experts.weight1")
    if w1 is None:
        return _sequential_experts(state, prefix)
    w2 = state[prefix + "mlp.experts.weight2"]
    hidden, f_r = model.hidden_size, model.moe_ffn_size // tp
    fc1 = w1.reshape(-1, hidden, (2 if model.swiglu else 1) * f_r).transpose(1, 2)
    fc2 = w2.reshape(-1, f_r, hidden).transpose(1, 2)
    return fc1.contiguous(), fc2.contiguous()


# ---------------------------------------------------------------- torch_dist


def extra_state_keys(model: ModelConfig, spec: str) -> list[str]:
    """The ``_extra_state`` ShardedObjects Megatron-core's torch_dist holds, under their unique keys
    (``<key>/shard_<offset>_<shape>``: ``shard_<layer>_<L>`` when stacked, ``shard_0_1`` otherwise)."""
    keys = []
    for layer in range(model.num_layers):
        for rest in _layer_extra_states(model, spec, layer):
            keys.append(f"decoder.layers.{rest}/shard_{layer}_{model.num_layers}" if names.is_stacked(model)
                        else f"decoder.layers.{layer}.{rest}/shard_0_1")
    for depth in range(model.mtp_num_layers or 0):  # an MTP depth's projection and layer (named as layer L + depth)
        prefix = f"mtp.layers.{depth}."
        keys.append(f"{prefix}eh_proj._extra_state/shard_0_1")
        keys += [f"{prefix}transformer_layer.{rest}/shard_0_1"
                 for rest in _layer_extra_states(model, spec, model.num_layers + depth)]
    keys.append("output_layer._extra_state/shard_0_1")
    return keys


def save_torch_dist(root: str, iteration: int, config: Config, mglobal: dict[str, torch.Tensor], padded_vocab: int,
                    *, tp: int, pp: int, ep: int, spec: str, consumed_samples: int = 0,
                    extra: dict[str, Any] | None = None, rng: dict[tuple[int, int], dict] | None = None) -> None:
    """Write Megatron-core's torch_dist: its keys (DCP; optimizer state under ``optimizer.state.*`` when
    ``mglobal`` holds it), ``metadata.json`` and ``common.pt`` with ``args`` and ``extra`` (``opt_param_scheduler``,
    ``optimizer``); ``rng``: Megatron-LM's ``rng_state`` entry of each (tp rank, pp rank) at layout tp x pp."""
    from megatron_like.training.dist_checkpointing import write_global_state

    path = os.path.join(root, f"iter_{iteration:07d}")
    state: dict[str, Any] = dict(mglobal)
    # Megatron-core stores each ShardedObject as torch.save of the list of its local objects (strategies/torch.py)
    state.update({key: [None] for key in extra_state_keys(config.model, spec)})
    state.update({rng_object_key(t, p, tp, pp): [entry] for (t, p), entry in (rng or {}).items()})
    write_global_state(path, state)
    with open(os.path.join(path, "metadata.json"), "w") as f:
        json.dump(METADATA_JSON, f)
    args = megatron_args(config, padded_vocab, iteration, tp=tp, pp=pp, ep=ep, spec=spec, ckpt_format="torch_dist",
                         experts="grouped", consumed_samples=consumed_samples)
    ckpt.save_atomically(os.path.join(path, "common.pt"), {
        "args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
        "num_floating_point_operations_so_far": 0, **(extra or {})})
    ckpt.write_tracker(root, iteration)


def is_megatron_torch_dist(it_dir: str) -> bool:
    """Whether ``it_dir`` holds Megatron-core's torch_dist (its ``metadata.json``)."""
    return os.path.isfile(os.path.join(it_dir, "metadata.json"))


def read_args(it_dir: str) -> argparse.Namespace:
    """The ``args`` of a Megatron-LM checkpoint iteration directory (either format)."""
    if is_megatron_torch_dist(it_dir):
        path = os.path.join(it_dir, "common.pt")
    else:
        found = sorted(d for d in os.listdir(it_dir) if d.startswith("mp_rank_"))
        if not found:
            raise ckpt.CheckpointError(f"{it_dir} holds neither metadata.json (torch_dist) nor mp_rank_* "
                                       "directories (legacy torch): not a Megatron-LM checkpoint")
        path = os.path.join(it_dir, found[0], FILE)
    args = read_megatron_file(path).get("args")
    if not isinstance(args, argparse.Namespace):
        raise ckpt.CheckpointError(f"{path} holds no Megatron-LM args (an argparse.Namespace under 'args')")
    return args


def model_and_optimizer_keys(it_dir: str) -> tuple[list[str], list[str]]:
    """The tensor keys of Megatron-core's torch_dist iteration directory: the model's (its sharded keys) and the
    optimizer's, in the model-space naming ``optimizer.state.<kind>.<model key>``; ShardedObjects (``_extra_state``,
    ``rng_state``, stored as bytes) are neither. A distributed optimizer saved ``dp_reshardable`` (Megatron-LM's
    default; flat buffers under ``optimizer.distributed.*``) is a one-line CheckpointError naming the way out."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from megatron_like.training.checkpoint_integrity import read_dcp_metadata

    tensors = sorted(k for k, v in read_dcp_metadata(it_dir).state_dict_metadata.items()
                     if isinstance(v, TensorStorageMetadata))
    if any(k.startswith("optimizer.distributed.") for k in tensors):
        raise ckpt.CheckpointError(
            f"{it_dir} holds Megatron-LM's distributed optimizer state in its dp_reshardable layout (flat buffers of "
            "one data-parallel layout): not read here; pass --no-load-optim, or save it in Megatron-LM with "
            "--dist-ckpt-optim-fully-reshardable")
    optimizer = [k for k in tensors if k.startswith("optimizer.state.")]
    return [k for k in tensors if not k.startswith("optimizer.")], optimizer


def load_torch_dist(it_dir: str, keys: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Megatron-core's global tensors ``keys`` (default: the model's) of a torch_dist iteration directory."""
    from megatron_like.training.dist_checkpointing import read_full_tensors

    root, name = os.path.split(it_dir.rstrip(os.sep))
    keys = model_and_optimizer_keys(it_dir)[0] if keys is None else keys
    return read_full_tensors(root, keys, int(name[len("iter_"):]))
