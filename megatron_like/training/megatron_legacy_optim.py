"""The ``optimizer`` entry of Megatron-LM's legacy ``model_optim_rng.pt`` files, read and written (docs/checkpoints.md,
"Megatron-LM checkpoints").

Megatron-LM's default optimizer (no ``--use-distributed-optimizer``) saves in each ``mp_rank`` file its
``optimizer.state_dict()``, read from megatron-core 0.16.1 (``optimizer/__init__.py`` ``_get_param_groups``,
``get_megatron_optimizer``; ``optimizer/optimizer.py`` ``FP32Optimizer``, ``Float16OptimizerWithFloat16Params``,
``ChainedOptimizer``) and seen from its ``GPTModel`` on CPU::

    fp32 params   torch AdamW's state dict: {"state": {i: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups": [...]}
    bf16 / fp16   {"optimizer": that state dict (of the fp32 masters), "fp32_from_fp16_params": [[master, ...] per
                  group], "grad_scaler": ... (fp16 only)}
    ep > 1        a list: the dense parameters' entry, then the experts' (their own optimizer)

Parameter ``i`` counts through the param groups in order; each group lists its parameters in the model's
``named_parameters`` order, which is also the order of the parameter entries of the file's ``model`` state dict. The
groups: weight-decayed parameters first (``wd_mult`` 1), then biases and 1-D parameters (``wd_mult`` 0). Experts
(``.mlp.experts.``) join the dense groups at ep 1 (their ``allreduce`` flag is set only under expert parallelism).
The distributed optimizer's legacy ``distrib_optim.pt`` (flat buffers of its grad buckets) is not read here.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_like.config import Config
from megatron_like.training import checkpointing as ckpt

KINDS = ("exp_avg", "exp_avg_sq", "master")
"""Our optimizer state kinds (``optimizer.<kind>.<name>``) that the legacy entry holds (masters: bf16 / fp16 runs)."""


def param_group(config: Config, wd_mult: float, expert: bool = False) -> dict[str, Any]:
    """One of Megatron-core's param groups without its ``params``: torch AdamW's values and Megatron-core's own
    (``wd_mult`` 1: decayed weights; 0: biases and norms), as its ``_get_param_groups`` builds them."""
    o = config.optimizer
    return {"is_expert_parallel": expert, "default_config": True, "wd_mult": wd_mult, "lr_mult": 1.0,
            "is_decoupled_lr": False, "max_lr": o.lr, "min_lr": o.min_lr, "lr": o.lr,
            "betas": (o.adam_beta1, o.adam_beta2), "eps": o.adam_eps, "weight_decay": o.weight_decay * wd_mult,
            "amsgrad": False, "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
            "fused": None, "decoupled_weight_decay": True}


def parameter_names(model_state: dict[str, Any]) -> list[str]:
    """The parameters of a legacy ``model`` state dict, in its (the module's) order: not ``_extra_state`` entries,
    not the router's ``expert_bias`` buffer."""
    return [k for k, v in model_state.items() if isinstance(v, torch.Tensor)
            and not k.endswith(("_extra_state", ".expert_bias"))]


def _no_decay(name: str, tensor: torch.Tensor) -> bool:
    """Megatron-core's standard override: biases and 1-D parameters take ``wd_mult`` 0."""
    return name.endswith(".bias") or tensor.ndim == 1


def _optimizers(model_state: dict[str, Any], expert_optimizer: bool) -> list[list[list[str]]]:
    """Per optimizer (dense; experts when ``expert_optimizer``), its groups' parameter names (decayed, not)."""
    params = parameter_names(model_state)
    members = [[n for n in params if not expert_optimizer or ".mlp.experts." not in n]]
    if expert_optimizer:
        members.append([n for n in params if ".mlp.experts." in n])
    return [[[n for n in names if not _no_decay(n, model_state[n])], [n for n in names if _no_decay(n, model_state[n])]]
            for names in members]


def optimizer_entry(model_state: dict[str, Any], moments: dict[str, dict[str, torch.Tensor]], step: float,
                    config: Config, ep: int) -> dict[str, Any] | list[dict[str, Any]]:
    """The ``optimizer`` entry of one rank's legacy file: ``model_state`` its ``model`` (Megatron-core's order),
    ``moments`` our kinds (``KINDS``; ``master`` only for bf16 / fp16 parameters) under the same names and slices."""
    entries = []
    for optimizer_index, groups in enumerate(_optimizers(model_state, ep > 1)):
        expert = optimizer_index == 1
        state: dict[int, dict[str, torch.Tensor]] = {}
        param_groups, masters, index = [], [], 0
        for wd_mult, names in zip((1.0, 0.0), groups):
            if not names and expert:
                continue  # the experts' optimizer has no group without weight decay unless some expert has a bias
            ids = list(range(index, index + len(names)))
            index += len(names)
            for i, name in zip(ids, names):
                state[i] = {"step": torch.tensor(float(step)), "exp_avg": moments["exp_avg"][name],
                            "exp_avg_sq": moments["exp_avg_sq"][name]}
            param_groups.append({**param_group(config, wd_mult, expert), "params": ids})
            if "master" in moments:
                masters.append([moments["master"][name] for name in names])
        adam = {"state": state, "param_groups": param_groups}
        entries.append(adam if "master" not in moments else {"optimizer": adam, "fp32_from_fp16_params": masters})
    return entries[0] if len(entries) == 1 else entries


def read_optimizer_entry(model_state: dict[str, Any], entry: Any, path: str
                         ) -> tuple[dict[str, dict[str, torch.Tensor]], float | None]:
    """(our kinds -> {Megatron-core name: this rank's tensor}, AdamW's step count) of one rank's legacy
    ``optimizer`` entry (inverse of :func:`optimizer_entry`); a one-line CheckpointError naming ``path`` when it
    does not fit the ``model`` state dict's parameters."""
    entries = entry if isinstance(entry, list) else [entry]
    out: dict[str, dict[str, torch.Tensor]] = {kind: {} for kind in KINDS}
    steps: set[float] = set()
    try:
        for groups, one in zip(_optimizers(model_state, len(entries) > 1), entries, strict=True):
            adam = one["optimizer"] if "fp32_from_fp16_params" in one else one
            masters = one.get("fp32_from_fp16_params")
            by_decay = {1.0: groups[0], 0.0: groups[1]}
            for g, saved in enumerate(adam["param_groups"]):
                names = by_decay[float(saved.get("wd_mult", 1.0))]
                if len(names) != len(saved["params"]):
                    raise ValueError(f"a param group of {len(saved['params'])} parameters where the model has "
                                     f"{len(names)}")
                for j, (name, i) in enumerate(zip(names, saved["params"])):
                    per_param = adam["state"][i]
                    out["exp_avg"][name], out["exp_avg_sq"][name] = per_param["exp_avg"], per_param["exp_avg_sq"]
                    step = per_param.get("step", saved.get("step"))
                    if step is not None:
                        steps.add(float(step))
                    if masters is not None:
                        out["master"][name] = masters[g][j]
    except (KeyError, ValueError, TypeError, IndexError) as error:
        raise ckpt.CheckpointError(f"{path}: its optimizer entry is not Megatron-LM's non-distributed optimizer of "
                                   f"its model ({type(error).__name__}: {error}); pass --no-load-optim") from None
    if len(steps) > 1:
        raise ckpt.CheckpointError(f"{path}: the Megatron-LM optimizer holds several step counts {sorted(steps)}: "
                                   "only one shared by every parameter is read here")
    return {kind: part for kind, part in out.items() if part}, steps.pop() if steps else None
