"""The optimizer's state as pieces of global tensors, for torch_dist checkpoints (docs/checkpoints.md).

:class:`DistributedOptimizer` keeps, per ZeRO segment (the part of one parameter inside this rank's
shard), an fp32 master and AdamW's ``exp_avg`` / ``exp_avg_sq``, all flat. Here each of them becomes the
same pieces of a global tensor as the parameter itself (``megatron_like/model/sharded_state.py``):
``optimizer.exp_avg.<global param name>`` has the shape of the whole single-process parameter, so a
shard cut at any dp size, ZeRO stage or tp size reads the elements it now owns.

Masters are stored only where they differ from the parameters (bf16/fp16 runs); an fp32 run's master
*is* its parameter (``model.<name>``), and a loader takes its masters from there. The step count and the
loss scaler are plain values, stored once (see ``megatron_like/training/dist_checkpointing.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from megatron_like.model.sharded_state import GlobalPieces, flat_pieces, owned_segments, writes_segment
from megatron_like.optimizer.distributed_optimizer import DistributedOptimizer
from megatron_like.parallel_state import ParallelState

MOMENTS = ("exp_avg", "exp_avg_sq")
MASTER_PREFIX = "optimizer.master."


def _separate_masters(optimizer: DistributedOptimizer) -> dict[int, bool]:
    """``{id(bucket): master is its own fp32 tensor}`` (False: the master is the param shard itself)."""
    return {id(b): not alias for b, alias in zip(optimizer.buckets, optimizer.master_is_param)}


def _segments(optimizer: DistributedOptimizer, model: list[nn.Module], ps: ParallelState) -> list:
    owned = list(owned_segments(model, ps))
    if len(owned) != len(optimizer.segments):
        raise RuntimeError(f"{len(owned)} ZeRO segments in the model's buffers but {len(optimizer.segments)} "
                           "in the optimizer: they were built from different models")
    return list(zip(owned, optimizer.segments))


def optimizer_step(optimizer: DistributedOptimizer) -> float | None:
    """AdamW's step count (equal for every parameter: all step together); None before the first step."""
    steps = [state["step"] for state in optimizer.inner.state.values() if "step" in state]
    return float(steps[0]) if steps else None


def optimizer_save_pieces(optimizer: DistributedOptimizer, model: list[nn.Module],
                          ps: ParallelState) -> dict[str, GlobalPieces]:
    """The masters (when separate) and AdamW moments this rank writes: each owned segment once."""
    separate = _separate_masters(optimizer)
    zero = optimizer.data_parallel.zero_stage
    out: dict[str, GlobalPieces] = {}
    for (placement, param, bucket, _, _, plo, phi), segment in _segments(optimizer, model, ps):
        if not writes_segment(placement, ps, zero):
            continue
        state = optimizer.inner.state.get(segment.master, {})
        flats = {kind: state[kind] for kind in MOMENTS if kind in state}
        if separate[id(bucket)]:
            flats["master"] = segment.master
        for kind, flat in flats.items():
            entry = out.setdefault(f"optimizer.{kind}.{placement.name}", GlobalPieces(placement.global_shape))
            entry.pieces += flat_pieces(placement, tuple(param.shape), flat.detach(), plo, phi)
    return out


def optimizer_load_pieces(optimizer: DistributedOptimizer, model: list[nn.Module], ps: ParallelState,
                          master_prefix: str | None,
                          with_moments: bool) -> tuple[dict[str, GlobalPieces], Callable[[float | None], None]]:
    """What this rank reads for its own segments, and a function that installs it once read.

    ``master_prefix``: where separate masters come from (``optimizer.master.``, or ``model.`` for a
    checkpoint of an fp32 run), None to leave them. ``with_moments``: read AdamW's moments (False when the
    checkpoint has none: saved before the first step or with --no-save-optim).
    Returns ``(pieces, install)`` (pieces in this run's global shapes: the caller fits them to the saved
    ones); call ``install(step)`` after the read.
    """
    separate = _separate_masters(optimizer)
    out: dict[str, GlobalPieces] = {}
    moments: dict[torch.Tensor, dict[str, torch.Tensor]] = {}

    def add(key: str, placement, param, flat: torch.Tensor, plo: int, phi: int) -> None:
        entry = out.setdefault(key, GlobalPieces(placement.global_shape))
        entry.pieces += flat_pieces(placement, tuple(param.shape), flat, plo, phi)

    for (placement, param, bucket, _, _, plo, phi), segment in _segments(optimizer, model, ps):
        if with_moments:
            fresh = {kind: torch.zeros_like(segment.master) for kind in MOMENTS}
            moments[segment.master] = fresh
            for kind, flat in fresh.items():
                add(f"optimizer.{kind}.{placement.name}", placement, param, flat, plo, phi)
        if master_prefix is not None and separate[id(bucket)]:
            add(master_prefix + placement.name, placement, param, segment.master.detach(), plo, phi)

    def install(step: float | None) -> None:
        if master_prefix is not None and any(separate.values()):
            optimizer.master_loaded = True
        if not with_moments or step is None:
            return
        # Through torch's own load_state_dict, which puts each value on its parameter's device and
        # dtype (fused AdamW keeps `step` on the device, CPUAdam on the host).
        state = optimizer.inner.state_dict()
        params = [p for group in optimizer.inner.param_groups for p in group["params"]]
        state["state"] = {}
        for index, param in enumerate(params):
            fresh = moments.get(param) or {kind: torch.zeros_like(param) for kind in MOMENTS}
            state["state"][index] = {"step": torch.tensor(step, dtype=torch.float32), **fresh}
        optimizer.inner.load_state_dict(state)

    return out, install
