"""``--load`` of a Megatron-LM checkpoint, without a conversion step (docs/checkpoints.md, "Megatron-LM checkpoints").

A checkpoint directory is Megatron-LM's when its iteration directory holds Megatron-core's ``metadata.json``
(torch_dist) or ``mp_rank_*`` files with ``args`` instead of our ``config`` (its legacy torch format). It is read
whole, in every rank, into our *global state*: ``model.<name>`` (single-process names, global shapes) and, from a
torch_dist checkpoint, ``optimizer.{exp_avg,exp_avg_sq,master}.<name>``, the keys of our own torch_dist
checkpoints. Each rank then copies the pieces its layout holds (``model/sharded_state.py``,
``optimizer/sharded_state.py``), so any tp / pp / ep / dp / ZeRO layout loads it. Read with it: the iteration,
the consumed samples (``args.consumed_train_samples``), the lr schedule (``opt_param_scheduler``, counted in samples
there, in iterations here), AdamW's step count and, at the checkpoint's tensor x pipeline layout, each rank's RNG
states (``rng_state``), and the optimizer state of its legacy files (``megatron_legacy_optim.py``). Not read: its
distributed optimizer's legacy ``distrib_optim.pt`` and its ``dp_reshardable`` torch_dist layout (--no-load-optim).
Every rank holds the whole model in host memory while it loads: for a model larger than that, convert offline
(tools/convert_megatron.py).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megatron_like.config import Config
from megatron_like.config.compare import refused_model_change
from megatron_like.model import megatron_names as names
from megatron_like.model.sharded_state import GlobalPieces, model_load_pieces
from megatron_like.parallel_state import ParallelState
from megatron_like.training import checkpointing as ckpt
from megatron_like.training import megatron_format as mf
from megatron_like.training.resume import resume_notice

MASTER_PREFIX = "optimizer.master."


@dataclass
class MegatronCheckpoint:
    """One iteration of a Megatron-LM checkpoint, opened (arguments and plain entries read, no tensors)."""

    path: str
    """The ``iter_XXXXXXX`` directory."""
    kind: str
    """``torch_dist`` or ``torch`` (legacy)."""
    args: argparse.Namespace
    config: Config
    """Ours, from ``args`` (``megatron_format.config_from_args``)."""
    common: dict[str, Any]
    """``common.pt`` (torch_dist) or the first rank's file without its ``model`` (legacy)."""


def megatron_kind(it_dir: str) -> str | None:
    """``torch_dist`` or ``torch`` when the iteration directory ``it_dir`` holds a Megatron-LM checkpoint, else None.
    Ours never has ``metadata.json`` nor ``args``; a legacy file is read memory-mapped, without its tensors (one
    that does not open is left to the loader's checks)."""
    if mf.is_megatron_torch_dist(it_dir):
        return "torch_dist"
    if not os.path.isdir(it_dir):
        return None
    found = sorted(d for d in os.listdir(it_dir) if d.startswith("mp_rank_"))
    path = os.path.join(it_dir, found[0], mf.FILE) if found else ""
    if not os.path.isfile(path):
        return None
    try:
        state = mf.read_megatron_file(path, mmap=True, verify=False)
    except ckpt.CheckpointError:  # a damaged file: our own checks name the problem in their words
        return None
    return "torch" if "args" in state and "config" not in state else None


def open_megatron(it_dir: str, kind: str) -> MegatronCheckpoint:
    """Read the arguments and plain entries of a Megatron-LM iteration directory (one-line CheckpointErrors)."""
    if kind == "torch_dist":
        path = os.path.join(it_dir, ckpt.DIST_COMMON_FILE)
        common = mf.read_megatron_file(path)
    else:
        path = os.path.join(it_dir, sorted(d for d in os.listdir(it_dir) if d.startswith("mp_rank_"))[0], mf.FILE)
        common = {k: v for k, v in mf.read_megatron_file(path, mmap=True, verify=False).items()
                  if not k.startswith("model")}
    args = common.get("args")
    if not isinstance(args, argparse.Namespace):
        raise ckpt.CheckpointError(f"{path} holds no Megatron-LM args (an argparse.Namespace under 'args')")
    try:
        config = mf.config_from_args(args)
    except (TypeError, ValueError, AttributeError) as error:
        raise ckpt.CheckpointError(f"the Megatron-LM arguments of {it_dir} describe no model of this codebase: "
                                   f"{error}") from None
    return MegatronCheckpoint(it_dir, kind, args, config, common)


def read_global_state(checkpoint: MegatronCheckpoint, with_optimizer: bool) -> dict[str, torch.Tensor]:
    """Our global state of a Megatron-LM checkpoint: ``model.<name>`` and (``with_optimizer``)
    ``optimizer.<kind>.<name>`` for every optimizer tensor it holds, at its padded vocabulary."""
    m = checkpoint.config.model
    try:
        if checkpoint.kind == "torch":
            parts, _ = mf.load_legacy(checkpoint.path, checkpoint.args, m, with_optimizer)
            out = {"model." + k: v for k, v in names.from_megatron_layers(parts.pop("model"), m).items()}
            for kind, part in parts.items():
                out.update({f"optimizer.{kind}.{k}": v for k, v in names.from_megatron_layers(part, m).items()})
            return out
        model_keys, optimizer_keys = mf.model_and_optimizer_keys(checkpoint.path)
        tensors = mf.load_torch_dist(checkpoint.path, model_keys + (optimizer_keys if with_optimizer else []))
        out = {"model." + k: v for k, v in names.from_megatron_global({k: tensors[k] for k in model_keys}, m).items()}
        theirs_to_ours = {theirs: ours for ours, theirs in mf.OPTIMIZER_KINDS.items()} | {"param": "master"}
        for theirs, ours in theirs_to_ours.items():
            prefix = f"optimizer.state.{theirs}."
            part = {k[len(prefix):]: tensors[k] for k in optimizer_keys if k.startswith(prefix)}
            if part and with_optimizer:
                out.update({f"optimizer.{ours}.{k}": v for k, v in names.from_megatron_global(part, m).items()})
        return out
    except KeyError as error:
        raise ckpt.CheckpointError(f"{checkpoint.path}: {str(error).strip(chr(39))}") from None


def read_megatron_rng(checkpoint: MegatronCheckpoint, tp_rank: int, pp_rank: int, dp_rank: int = 0
                      ) -> dict[str, Any] | None:
    """Our RNG state (``checkpointing.set_rng_state``'s) of rank (tp, pp, dp) of the checkpoint's own layout, from its
    ``rng_state``: a ShardedObject per (pp, tp) in torch_dist, an entry of each ``mp_rank`` file in the legacy
    format; a list of one item (every dp rank's), or of one per dp rank (``--data-parallel-random-init``). None when
    it holds none (``--no-save-rng``). Read with the weights-only unpickler (numpy's generator allowed)."""
    args = checkpoint.args
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    try:
        if checkpoint.kind == "torch_dist":
            key = mf.rng_object_key(tp_rank, pp_rank, tp, pp)
            from megatron_like.training.checkpoint_integrity import read_dcp_metadata

            if key not in read_dcp_metadata(checkpoint.path).state_dict_metadata:
                return None
            with torch.serialization.safe_globals(mf.safe_globals()):
                states = mf.load_torch_dist(checkpoint.path, [key])[key]
        else:
            ep = getattr(args, "expert_model_parallel_size", 1) or 1
            path = os.path.join(checkpoint.path, mf.legacy_dir_name(tp_rank, pp_rank, pp, 0, ep), mf.FILE)
            states = mf.read_megatron_file(path, mmap=True, verify=False).get("rng_state")
        if not states:
            return None
        return mf.rng_from_megatron(states[dp_rank] if len(states) > 1 else states[0])
    except (KeyError, TypeError, ValueError, IndexError) as error:
        raise ckpt.CheckpointError(f"{checkpoint.path}: the RNG state of tp rank {tp_rank}, pp rank {pp_rank} is not "
                                   f"Megatron-LM's ({type(error).__name__}: {error}); pass --no-load-rng") from None


def saved_step(checkpoint: MegatronCheckpoint) -> float | None:
    """AdamW's step count of the checkpoint's optimizer (None: it holds none): torch_dist's ``common.pt``, or the
    legacy ``optimizer`` entry of its first file."""
    entry = checkpoint.common.get("optimizer")
    if checkpoint.kind == "torch_dist" or entry is None:
        return mf.optimizer_step_of(entry)
    from megatron_like.training.megatron_legacy_optim import read_optimizer_entry

    first = sorted(d for d in os.listdir(checkpoint.path) if d.startswith("mp_rank_"))[0]
    path = os.path.join(checkpoint.path, first, mf.FILE)
    return read_optimizer_entry(mf.read_megatron_file(path, mmap=True, verify=False)["model"], entry, path)[1]


def saved_schedule(checkpoint: MegatronCheckpoint) -> dict[str, Any] | None:
    """Our scheduler's state of the checkpoint's ``opt_param_scheduler`` (None when it has none)."""
    state = checkpoint.common.get("opt_param_scheduler")
    if state is None:
        return None
    return mf.scheduler_from_megatron(state, checkpoint.config.global_batch_size)


def check_megatron_checkpoint(checkpoint: MegatronCheckpoint, config: Config) -> None:
    """What this run refuses before reading any tensor: another model (a flag that contradicts the checkpoint's
    ``args``), optimizer state this module does not read, an lr schedule of a style we do not have."""
    problem = refused_model_change(checkpoint.config.to_dict()["model"], config.model, config.checkpoint.finetune)
    if problem is not None:
        raise ckpt.CheckpointError(f"Megatron-LM checkpoint {checkpoint.path} {problem}")
    if config.checkpoint.finetune:
        return
    schedule = checkpoint.common.get("opt_param_scheduler")
    if schedule is not None and schedule.get("lr_decay_style") not in ("constant", "linear", "cosine"):
        raise ckpt.CheckpointError(f"Megatron-LM checkpoint {checkpoint.path} has --lr-decay-style "
                                   f"{schedule.get('lr_decay_style')}, not implemented here (constant, linear, "
                                   "cosine); pass --finetune to start a new schedule from its weights")
    if config.checkpoint.load_optim and checkpoint.kind == "torch":
        first = os.path.join(checkpoint.path, sorted(d for d in os.listdir(checkpoint.path)
                                                     if d.startswith("mp_rank_"))[0])
        if os.path.isfile(os.path.join(first, "distrib_optim.pt")):
            raise ckpt.CheckpointError(f"Megatron-LM checkpoint {checkpoint.path} holds its distributed optimizer's "
                                       "legacy distrib_optim.pt (flat buffers of its grad buckets), not read here; "
                                       "pass --no-load-optim (weights, iteration, lr schedule and RNG are read)")
    elif config.checkpoint.load_optim and checkpoint.common.get("optimizer") is not None:
        mf.model_and_optimizer_keys(checkpoint.path)  # refuses a dp_reshardable distributed optimizer


def _vocab_multiples(checkpoint: MegatronCheckpoint, config: Config) -> tuple[int, int]:
    saved = checkpoint.config.model.make_vocab_size_divisible_by * checkpoint.args.tensor_model_parallel_size
    return saved, config.model.make_vocab_size_divisible_by * config.parallel.tensor_model_parallel_size


def fill_pieces(pieces: dict[str, GlobalPieces], tensors: dict[str, torch.Tensor]) -> None:
    """Copy each piece's block of its whole global tensor in ``tensors`` into the piece (in place)."""
    for key, entry in pieces.items():
        for offsets, local in entry.pieces:
            block = tensors[key][tuple(slice(o, o + n) for o, n in zip(offsets, local.shape))]
            local.copy_(block)


def load_megatron_checkpoint(it_dir: str, kind: str, config: Config, ps: ParallelState, model: list[nn.Module],
                             optimizer: Any, scheduler: Any) -> tuple[int, int]:
    """Load a Megatron-LM checkpoint into this rank at this run's layout; returns (iteration, consumed samples).

    The model must hold full parameters (at ZeRO-3, inside ``gathered_parameters(model, write_back=True)``).
    ``--finetune`` reads the weights only and returns (0, 0).
    """
    from megatron_like.optimizer.sharded_state import optimizer_load_pieces
    from megatron_like.training.dist_checkpointing import fit_to_saved

    checkpoint = open_megatron(it_dir, kind)
    check_megatron_checkpoint(checkpoint, config)
    finetune = config.checkpoint.finetune
    schedule = saved_schedule(checkpoint)
    notice = resume_notice(checkpoint.config.to_dict(), schedule, config, scheduler is not None)  # or refuse
    if notice and ps.rank == 0:
        print(notice, flush=True)
    step = saved_step(checkpoint)
    load_optim = optimizer is not None and config.checkpoint.load_optim and not finetune and step is not None
    tensors = read_global_state(checkpoint, with_optimizer=load_optim)
    shapes = {k: tuple(t.shape) for k, t in tensors.items()}
    multiples = _vocab_multiples(checkpoint, config)

    params = model_load_pieces(model, ps)
    has_masters = any(k.startswith(MASTER_PREFIX) for k in tensors)
    if all(p.dtype == torch.float32 for chunk in model for p in chunk.parameters()) and has_masters:
        # An fp32 run's params are its masters: Megatron-core's fp32 copies hold the exact values.
        tensors.update({k: tensors[MASTER_PREFIX + k[len("model."):]] for k in params})
    fit_to_saved(params, shapes, it_dir, multiples)
    fill_pieces(params, tensors)
    if finetune:
        return 0, 0
    if load_optim:
        with_moments = all(f"optimizer.{moment}.{k[len('model.'):]}" in tensors
                           for moment in ("exp_avg", "exp_avg_sq") for k in params)
        pieces, install = optimizer_load_pieces(optimizer, model, ps, MASTER_PREFIX if has_masters else "model.",
                                                with_moments)
        fit_to_saved(pieces, shapes, it_dir, multiples)
        fill_pieces(pieces, tensors)
        install(step)
    if scheduler is not None and schedule is not None:
        scheduler.load_state_dict(schedule)
    if config.checkpoint.load_rng:
        same_layout = (checkpoint.args.tensor_model_parallel_size, checkpoint.args.pipeline_model_parallel_size) == (
            ps.tp_size, ps.pp_size)
        generators = read_megatron_rng(checkpoint, ps.tp_rank, ps.pp_rank, ps.dp_rank) if same_layout else None
        if generators is not None:
            ckpt.set_rng_state(generators)
        elif ps.rank == 0:
            print(" > Megatron-LM checkpoint: its RNG states are not read (none saved, or another tensor/pipeline "
                  "layout); the generators stay seeded from --seed", flush=True)
    iteration = int(checkpoint.common.get("iteration", 0))
    return iteration, int(getattr(checkpoint.args, "consumed_train_samples", 0) or 0)
