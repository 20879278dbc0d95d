"""Our checkpoints written as Megatron-LM's (docs/checkpoints.md, "Megatron-LM checkpoints"): the export
``tools/convert_megatron.py --direction to-megatron`` runs, and ``--ckpt-naming megatron``, which saves a training
run's checkpoints in Megatron-LM's files directly.

``--ckpt-naming megatron`` saves through our own torch_dist writer first, into ``<save>/.megatron_staging`` (every
rank its pieces, as any save), then rank 0 reads that whole and writes Megatron-LM's files under ``<save>`` with
:func:`export_to_megatron`, the converter's code, and deletes the staging copy: the files are by construction the
converter's. The price: the checkpoint is written twice, and rank 0 holds the whole model and optimizer state in
host memory while it writes Megatron-LM's.
"""

from __future__ import annotations

import copy
import os
import shutil
from typing import Any

import torch
from torch import nn

from megatron_like.config import Config
from megatron_like.model import megatron_names as names
from megatron_like.model.state import (
    CHECKPOINT_FILE,
    VOCAB_PARAMS,
    checkpoint_iteration_dir,
    first_shard_dir,
    is_torch_dist,
    load_full_state,
    resize_vocab,
)
from megatron_like.parallel_state import ParallelState
from megatron_like.training import checkpointing as ckpt
from megatron_like.training import megatron_format as mf
from megatron_like.training.checkpoint_integrity import read_dcp_metadata
from megatron_like.training.checkpoint_validation import read_checkpoint_file
from megatron_like.training.megatron_legacy_optim import KINDS
from megatron_like.training.retention import retain_after_save

STAGING_DIR = ".megatron_staging"
"""Under ``--save``: where ``--ckpt-naming megatron`` writes our torch_dist before rank 0 rewrites it."""


def _our_run_state(load: str, iteration: int | None, config: Config
                   ) -> tuple[dict, dict[str, torch.Tensor], dict[tuple[int, int], dict]]:
    """(``common.pt``'s plain entries, our global optimizer tensors ``optimizer.<kind>.<name>``, the generators of
    data-parallel rank 0 at each (tp rank, pp rank)) of our checkpoint; a torch-format one gives its first file's
    entries, no optimizer tensors (its ZeRO shards are flat) and no generators."""
    it_dir = checkpoint_iteration_dir(load, iteration)
    root = os.path.dirname(it_dir)
    step = int(os.path.basename(it_dir)[len("iter_"):])
    if not is_torch_dist(it_dir):
        state = read_checkpoint_file(os.path.join(first_shard_dir(it_dir), CHECKPOINT_FILE), mmap=True, verify=False)
        return {k: state.get(k) for k in ("consumed_samples", "scheduler")}, {}, {}
    from megatron_like.training.dist_checkpointing import read_full_tensors

    common = read_checkpoint_file(os.path.join(it_dir, ckpt.DIST_COMMON_FILE))
    saved = read_dcp_metadata(it_dir).state_dict_metadata
    optimizer = read_full_tensors(root, [k for k in saved if k.startswith("optimizer.")], step)
    p = config.parallel
    rng_keys = {(t, s): f"rng.tp{t}.pp{s}.dp0" for t in range(p.tensor_model_parallel_size)
                for s in range(p.pipeline_model_parallel_size)}
    rng_keys = {at: key if key in saved else key + ".cp0" for at, key in rng_keys.items()}
    if not all(key in saved for key in rng_keys.values()):
        return common, optimizer, {}
    generators = read_full_tensors(root, list(rng_keys.values()), step)
    return common, optimizer, {at: generators[key] for at, key in rng_keys.items()}


def _optimizer_to_megatron(tensors: dict[str, torch.Tensor], full: dict[str, torch.Tensor], config: Config,
                           spec: str) -> dict[str, torch.Tensor]:
    """Megatron-core's ``optimizer.state.<kind>.<key>`` of our global optimizer tensors; an fp32 run's masters are
    its parameters (``full``), which Megatron-core's distributed optimizer keeps as ``fp32_param`` all the same."""
    m, out = config.model, {}
    for ours, theirs in mf.OPTIMIZER_KINDS.items():
        part = {k[len(f"optimizer.{ours}."):]: v for k, v in tensors.items() if k.startswith(f"optimizer.{ours}.")}
        if ours == "master" and not part:
            part = {k: v.float() for k, v in full.items()}
        if part:
            out.update({f"optimizer.state.{theirs}.{k}": v for k, v in names.to_megatron_global(part, m, spec).items()})
    return out


def export_to_megatron(load: str, save: str, iteration: int | None = None, *, ckpt_format: str = "torch_dist",
                       spec: str = "local", experts: str = "grouped", tp: int | None = None, pp: int | None = None,
                       ep: int | None = None) -> str:
    """Write our checkpoint ``load`` (either format, any layout; default: its latest iteration) as Megatron-LM's
    under ``save``: ``ckpt_format`` torch_dist or torch (legacy), layer ``spec`` local or te, legacy ``experts``
    grouped or sequential, at layout tp x pp x ep (default: the source's). Returns a one-line summary."""
    config, full = load_full_state(load, iteration)
    p, m = config.parallel, config.model
    tp = tp or p.tensor_model_parallel_size
    pp = pp or p.pipeline_model_parallel_size
    ep = ep or p.expert_model_parallel_size
    if m.num_layers % pp:
        raise ValueError(f"--target-pipeline-model-parallel-size {pp} does not divide the {m.num_layers} layers")
    rows = full[VOCAB_PARAMS[0]].shape[0]
    target = copy.deepcopy(config)  # Megatron-LM pads the vocabulary for the target tp
    target.parallel.tensor_model_parallel_size = tp
    padded = target.padded_vocab_size(m.vocab_size or rows)
    full = {k: resize_vocab(v, padded) if k in VOCAB_PARAMS else v for k, v in full.items()}
    iteration = int(os.path.basename(checkpoint_iteration_dir(load, iteration))[len("iter_"):])
    common, optimizer, generators = _our_run_state(load, iteration, config)
    optimizer = {k: resize_vocab(v, padded) if k.endswith(VOCAB_PARAMS) else v for k, v in optimizer.items()}
    # Generators belong to one rank of one layout: carried only when the tp x pp layout stays
    same_layout = (tp, pp) == (p.tensor_model_parallel_size, p.pipeline_model_parallel_size)
    rng = {at: mf.rng_to_megatron(state) for at, state in generators.items()} if same_layout and generators else None
    extra: dict[str, Any] = {}
    if common.get("scheduler") is not None:
        extra["opt_param_scheduler"] = mf.scheduler_to_megatron(common["scheduler"], config)
    consumed = int(common.get("consumed_samples") or 0)
    per_layer = names.to_megatron_layers(full, m, spec, sharded=ckpt_format == "torch_dist")
    if ckpt_format == "torch":
        kinds = {kind: {k[len(f"optimizer.{kind}."):]: v for k, v in optimizer.items()
                        if k.startswith(f"optimizer.{kind}.")} for kind in KINDS}
        moments = {kind: names.to_megatron_layers(part, m, spec, sharded=False) for kind, part in kinds.items() if part}
        mf.save_legacy(save, iteration, config, per_layer, padded, tp=tp, pp=pp, ep=ep, spec=spec, experts=experts,
                       consumed_samples=consumed, extra=extra, rng=rng, moments=moments or None,
                       step=(common.get("optimizer") or {}).get("step"))
        carried = ("with its optimizer state (Megatron-LM's non-distributed optimizer)" if moments
                   else "no optimizer state (the source holds none)")
    else:
        mglobal = names.stack_layers(per_layer, m.num_layers) if names.is_stacked(m) else per_layer
        if optimizer:
            mglobal.update(_optimizer_to_megatron(optimizer, full, config, spec))
            extra["optimizer"] = mf.optimizer_common((common.get("optimizer") or {}).get("step"), config)
        mf.save_torch_dist(save, iteration, config, mglobal, padded, tp=tp, pp=pp, ep=ep, spec=spec,
                           consumed_samples=consumed, extra=extra, rng=rng)
        carried = "with its optimizer state" if optimizer else "no optimizer state (the source holds none)"
    generators_note = "its RNG states" if rng else "no RNG states (none saved, or another tp x pp layout)"
    return (f"wrote a Megatron-LM {ckpt_format} checkpoint (iteration {iteration}, tp {tp}, pp {pp}, ep {ep}, "
            f"{spec} layer spec; {carried}; {generators_note}) to {save}")


def save_in_megatron_naming(root: str, iteration: int, config: Config, ps: ParallelState, model: list[nn.Module],
                            optimizer: Any, scheduler: Any, consumed_samples: int) -> str:
    """``--ckpt-naming megatron``: save ``iteration`` as Megatron-LM's files in ``--ckpt-format`` at this run's
    layout (module docstring); all ranks call it together. Returns the iteration directory."""
    from megatron_like.training.dist_checkpointing import save_dist_checkpoint

    staging = os.path.join(root, STAGING_DIR)
    ours = copy.deepcopy(config)
    ours.checkpoint.ckpt_format, ours.checkpoint.async_save = "torch_dist", False
    ours.checkpoint.keep_last_checkpoints = ours.checkpoint.keep_checkpoint_every = None
    save_dist_checkpoint(staging, iteration, ours, ps, model, optimizer, scheduler, consumed_samples)
    failure = None
    if ps.rank == 0:
        try:
            export_to_megatron(staging, root, iteration, ckpt_format=config.checkpoint.ckpt_format)
            shutil.rmtree(staging)
        except (OSError, ValueError, KeyError, ckpt.CheckpointError) as error:
            failure = ckpt.save_failure(iteration, ps.rank, error)
        else:
            retain_after_save(root, iteration, config.checkpoint.keep_last_checkpoints,
                              config.checkpoint.keep_checkpoint_every)
    ckpt.raise_agreed(failure, ps)
    return ckpt.iteration_dir(root, iteration)
