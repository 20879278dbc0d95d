"""The model as *global tensors*: which part of each whole-model parameter this rank holds.

A torch_dist checkpoint (docs/checkpoints.md) stores every parameter once, under its single-process
name (``layers.7.mlp.fc1.weight``: global layer index, whatever pp/vp stage holds it) and its global
shape; each rank reads and writes rectangular *pieces* of it at global offsets. So a checkpoint saved at
one tp x pp x vp x dp x ZeRO layout loads at any other: torch.distributed.checkpoint (DCP) matches the
pieces a rank asks for against the pieces that were written.

Where a rank's local tensor sits in the global one:

* tensor parallelism: a parameter with ``tensor_model_parallel`` is split along ``partition_dim`` in
  tp-rank order (offset ``tp_rank * local size``); other parameters are whole on every tp rank and are
  written by tp rank 0 only;
* pipeline (and virtual) stages: by the global layer index in the name;
* expert parallelism (MoE, docs/moe.md): an expert weight ``[E_local, ...]`` is a piece of the global
  ``[E, ...]`` over all experts, at ``ep_rank * E_local`` along dim 0, combined with the expert
  tensor-parallel split of each expert (over ``--expert-tensor-parallel-size`` ranks, which may differ from
  tp; :func:`expert_placement`); it is written by one expert-data-parallel replica (the ranks holding the
  same expert shards), as dense weights are written by one data-parallel replica;
* the tied word embedding: the last stage's copy (``shared_embedding``) has the first stage's name and
  is never written (the first stage owns it), but it is read like the original;
* the padded vocabulary (``--make-vocab-size-divisible-by * tp``) depends on tp: a checkpoint holds the
  padded rows of its own layout, and a loader reads the rows both layouts have (padding rows of a larger
  padding start at zero, see :func:`clip_to`);
* ZeRO: a rank's shard of a flat buffer is a flat range ``[lo, hi)`` of a parameter, which may start and
  end inside rows. :func:`flat_range_boxes` cuts it into at most ``2 * ndim - 1`` rectangular boxes that
  are each contiguous in the flat range, so each box is a *view* of the flat shard.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from megatron_like.model.gpt import WORD_EMBEDDINGS
from megatron_like.parallel_state import ParallelState

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""(offsets, sizes) of a rectangular block of a tensor."""

VOCAB_PARAMS = (WORD_EMBEDDINGS + ".weight", "output_layer.weight")
"""Parameters whose first dimension is the padded vocabulary (it depends on tp)."""


@dataclass
class GlobalPieces:
    """The pieces of one global tensor that this rank writes or reads.

    ``pieces``: ``(global offsets, local tensor)``; each local tensor is a view of the rank's storage
    (writes read from it, loads copy into it in place).
    """

    global_shape: tuple[int, ...]
    pieces: list[tuple[tuple[int, ...], torch.Tensor]] = field(default_factory=list)


def flat_range_boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[Box]:
    """Cut elements ``[lo, hi)`` of a row-major tensor of ``shape`` into rectangular boxes.

    The boxes come in flat order and each is one contiguous flat range, so box ``i`` is
    ``flat[start_i : start_i + prod(sizes_i)].view(sizes_i)`` with ``start_0 = lo``. Example: shape
    (4, 10), [15, 37) -> row 1 cols 5..9, rows 2, row 3 cols 0..6.
    """
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [((lo,), (hi - lo,))]
    row = math.prod(shape[1:])
    first, last = lo // row, (hi - 1) // row
    if first == last:  # inside one row: recurse into it
        return [((first,) + o, (1,) + s) for o, s in flat_range_boxes(shape[1:], lo - first * row, hi - first * row)]
    boxes = []
    if lo % row:  # partial head row
        boxes += flat_range_boxes(shape, lo, (first + 1) * row)
        first += 1
    full_end = hi // row
    if full_end > first:
        boxes.append(((first,) + (0,) * (len(shape) - 1), (full_end - first,) + tuple(shape[1:])))
    if hi % row:  # partial tail row
        boxes += flat_range_boxes(shape, full_end * row, hi)
    return boxes


@dataclass
class ParamPlacement:
    """Where one local parameter sits in its global tensor."""

    name: str
    """Single-process name (global layer index); the tied last-stage copy carries the embedding's."""
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    """Global offset of the local tensor's element (0, ..., 0)."""
    tp_replicated: bool
    """Whole on every tp rank (written by tp rank 0 only)."""
    tied_copy: bool
    """The last stage's copy of the tied word embedding (never written)."""
    expert: bool = False
    """An expert weight (MoE): replicated over the expert-data-parallel group, not the data-parallel one."""


def expert_placement(local_shape: tuple[int, ...], partition_dim: int, ep_rank: int, ep_size: int,
                     expert_tp_rank: int, expert_tp_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global shape, global offset) of one rank's expert weight ``[E_local, ...]`` in ``[E, ...]``.

    The rank holds experts ``ep_rank * E_local ...`` (dim 0) and, of each, the slice ``expert_tp_rank`` of
    ``expert_tp_size`` along ``partition_dim``. Every expert-layout choice enters through the arguments: the
    caller passes the expert tensor-parallel rank and size (``--expert-tensor-parallel-size``, the attention's
    tp by default), so the global tensor is the same whatever etp and ep the run uses.
    """
    shape, offset = list(local_shape), [0] * len(local_shape)
    shape[0] *= ep_size
    offset[0] = ep_rank * local_shape[0]
    shape[partition_dim] *= expert_tp_size
    offset[partition_dim] = expert_tp_rank * local_shape[partition_dim]
    return tuple(shape), tuple(offset)


def global_name(chunk: nn.Module, local_name: str) -> str:
    """``layers.0.mlp.fc1.weight`` of a chunk holding layer 5 -> ``layers.5.mlp.fc1.weight``."""
    if local_name.startswith("layers."):
        _, index, rest = local_name.split(".", 2)
        return f"layers.{chunk.layers[int(index)].layer}.{rest}"
    return local_name


def placements(chunk: nn.Module, ps: ParallelState) -> dict[nn.Parameter, ParamPlacement]:
    """The :class:`ParamPlacement` of every parameter of ``chunk`` (keyed by the parameter)."""
    out = {}
    for local_name, param in chunk.named_parameters():
        tied_copy = bool(getattr(param, "shared_embedding", False))
        name = VOCAB_PARAMS[0] if tied_copy else global_name(chunk, local_name)
        shape, offset = list(param.shape), [0] * param.ndim
        split = bool(getattr(param, "tensor_model_parallel", False))
        if getattr(param, "expert_parallel", False):
            # Split over the experts' own tensor parallelism (etp, the attention's tp by default), not tp.
            global_shape, global_offset = expert_placement(tuple(param.shape), param.partition_dim, ps.ep_rank,
                                                           ps.ep_size, ps.etp_rank, ps.expert_tp_size)
            out[param] = ParamPlacement(name, global_shape, global_offset, False, tied_copy, expert=True)
            continue
        if split:
            dim = param.partition_dim
            shape[dim] *= ps.tp_size
            offset[dim] = ps.tp_rank * param.shape[dim]
        out[param] = ParamPlacement(name, tuple(shape), tuple(offset), not split, tied_copy)
    return out


def flat_pieces(placement: ParamPlacement, local_shape: tuple[int, ...], flat: torch.Tensor,
                lo: int, hi: int) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """Global pieces of elements ``[lo, hi)`` of a flattened local parameter, as views of ``flat [hi - lo]``."""
    pieces, start = [], 0
    for offsets, sizes in flat_range_boxes(local_shape, lo, hi):
        n = math.prod(sizes)
        view = flat[start:start + n].view(sizes)
        pieces.append((tuple(o + g for o, g in zip(offsets, placement.offset)), view))
        start += n
    return pieces


def clip_to(pieces: list[tuple[tuple[int, ...], torch.Tensor]],
            saved_shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """The parts of ``pieces`` inside a saved tensor of ``saved_shape`` (rows beyond a smaller vocabulary
    padding are dropped: their local tensor keeps what it holds, zeros for fresh state)."""
    out = []
    for offsets, tensor in pieces:
        for dim, (o, limit) in enumerate(zip(offsets, saved_shape)):
            tensor = tensor.narrow(dim, 0, max(0, min(tensor.shape[dim], limit - o)))
        if tensor.numel():
            out.append((offsets, tensor))
    return out


def owned_segments(model: list[nn.Module], ps: ParallelState) -> Iterator[
        tuple[ParamPlacement, nn.Parameter, object, int, int, int, int]]:
    """``(placement, param, bucket, shard_lo, shard_hi, param_lo, param_hi)`` for every segment of this rank's
    ZeRO shards, in the optimizer's segment order (chunks, buckets, params), see buffers.py."""
    for chunk in model:
        where = placements(chunk, ps)
        for bucket in chunk.param_and_grad_buffer.buckets:
            for param, lo, hi, plo, phi in bucket.shard_segments():
                yield where[param], param, bucket, lo, hi, plo, phi


def writes_segment(placement: ParamPlacement, ps: ParallelState, zero_stage: int) -> bool:
    """Whether this rank writes its segment of a parameter: each global element is written exactly once.

    Without ZeRO every dp (x cp) rank holds the whole bucket (dp x cp rank 0 writes it); with ZeRO each writes
    its own shard. Expert weights likewise over the expert-data-parallel group (the ranks holding the same
    expert shards, whatever etp and ep are; their buckets are sharded there): no expert weight is
    tp-replicated (each etp rank holds its own slice, etp 1 included). A tp-replicated parameter is written
    by tp rank 0, the tied copy never.
    """
    if placement.tied_copy or (placement.tp_replicated and ps.tp_rank != 0):
        return False
    return zero_stage >= 1 or (ps.expert_dp_rank if placement.expert else ps.dp_cp_rank) == 0


def model_save_pieces(model: list[nn.Module], ps: ParallelState, zero_stage: int,
                      prefix: str = "model.") -> dict[str, GlobalPieces]:
    """The parameter pieces this rank writes: its ZeRO shard of each bucket (``param_shard``, which holds the
    current values at every stage, also between ZeRO-3 gathers), so no rank gathers the model."""
    out: dict[str, GlobalPieces] = {}
    for placement, param, bucket, lo, hi, plo, phi in owned_segments(model, ps):
        if writes_segment(placement, ps, zero_stage):
            entry = out.setdefault(prefix + placement.name, GlobalPieces(placement.global_shape))
            entry.pieces += flat_pieces(placement, tuple(param.shape), bucket.param_shard[lo:hi], plo, phi)
    return out


def model_buffers(model: list[nn.Module], prefix: str = "model.") -> dict[str, torch.Tensor]:
    """``{prefix + global name: buffer}`` of every persistent buffer of the chunks (e.g. a QAT quantizer's
    range ``amax``, a scalar). Buffers are whole on every rank: they are stored as plain values, not pieces."""
    out = {}
    for chunk in model:
        params = {name for name, _ in chunk.named_parameters()}
        for local_name in chunk.state_dict():
            if local_name not in params:
                out[prefix + global_name(chunk, local_name)] = chunk.get_buffer(local_name)
    return out


def model_load_pieces(model: list[nn.Module], ps: ParallelState, prefix: str = "model.") -> dict[str, GlobalPieces]:
    """Every local parameter whole, as a piece of its global tensor (load into full parameters: at ZeRO-3
    inside ``gathered_parameters(model, write_back=True)``). The last stage's tied copy reads the word
    embedding (on the V placement it lives on the same rank as the original: the reader then fills it from the
    original's piece, ``dist_checkpointing._set_twins_apart``)."""
    out: dict[str, GlobalPieces] = {}
    for chunk in model:
        for param, placement in placements(chunk, ps).items():
            key = prefix + placement.name
            entry = out.setdefault(key, GlobalPieces(placement.global_shape))
            entry.pieces.append((placement.offset, param.data))
    return out
