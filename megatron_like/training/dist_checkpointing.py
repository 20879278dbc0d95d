"""``--ckpt-format torch_dist``: checkpoints of global tensors that load at any parallel layout.

Layout of one checkpoint (docs/checkpoints.md)::

    <root>/latest_checkpointed_iteration.txt       last, atomically, by rank 0 (as the torch format)
    <root>/iter_0000100/.metadata                  DCP's index: every key, its global shape, its pieces
    <root>/iter_0000100/__R_0.distcp               the pieces rank R wrote
    <root>/iter_0000100/common.pt                  rank 0: iteration, consumed samples, args, scheduler,
                                                   AdamW step count, loss scaler (plain values)

Keys written through torch.distributed.checkpoint (DCP):

* ``model.<name>``: every parameter under its single-process name and shape;
* ``optimizer.exp_avg.<name>``, ``optimizer.exp_avg_sq.<name>`` and, when the params are not fp32,
  ``optimizer.master.<name>``: same shapes as the parameter;
* ``model.<name>`` of a persistent buffer (e.g. a QAT quantizer's range): a plain value (bytes), written
  by tp rank 0 and dp rank 0 of the stage holding it, as the torch format keeps dp rank 0's;
* ``rng.tp<T>.pp<P>.dp<D>``: the generators of the rank at those coordinates (bytes).

MoE expert weights (and their optimizer state) are global tensors over all experts, ``[E, ...]``, whatever
the expert-parallel size. Each rank writes only elements it owns (its ZeRO shard, tp rank 0 for
tp-replicated tensors, dp rank 0 without ZeRO, expert-dp rank 0 for its experts:
``megatron_like/model/sharded_state.py``), and reads the elements its own layout needs. RNG states belong
to one rank of one layout: they are restored when tp, pp, dp and ep sizes are the saved ones, and
otherwise the run keeps its generators seeded from --seed.

Reading: the index is unpickled only by ``checkpoint_integrity.read_dcp_metadata`` (an allow-list) and handed
to DCP by the reader; every piece read is checked against the CRC-32 its archive was saved with.

DCP runs its own collectives (gathering the rank plans, a barrier at the end) on the default process
group, so its ``save`` and ``load`` are called here rather than through ``megatron_like/collectives.py``.
"""

from __future__ import annotations

import contextlib
import copy
import os
import pickle
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megatron_like import collectives as comm
from megatron_like.config import Config
from megatron_like.model.sharded_state import (
    VOCAB_PARAMS,
    GlobalPieces,
    clip_to,
    model_buffers,
    model_load_pieces,
    model_save_pieces,
)
from megatron_like.optimizer.sharded_state import (
    MASTER_PREFIX,
    optimizer_load_pieces,
    optimizer_save_pieces,
    optimizer_step,
)
from megatron_like.parallel_state import ParallelState
from megatron_like.training import checkpointing as ckpt
from megatron_like.training.checkpoint_integrity import (
    EARLIER,
    check_storage_files,
    read_dcp_metadata,
)
from megatron_like.training.dcp_reader import DirectReader
from megatron_like.training.fault_injection import save_faults
from megatron_like.training.resume import resume_notice
from megatron_like.training.retention import retain_after_save
from megatron_like.training.signals import saving, watchdog_limit

# Format detection lives in checkpointing.py, which every run imports: this module pulls in DCP (and
# DTensor, sympy: ~0.8 s per process) and is imported only by runs that read or write torch_dist.
COMMON_FILE, DCP_METADATA = ckpt.DIST_COMMON_FILE, ckpt.DCP_METADATA
iteration_dir, is_dist_checkpoint = ckpt.iteration_dir, ckpt.is_dist_checkpoint


def _rng_key(ps: ParallelState) -> str:
    """This rank's RNG state's key (its cp rank only with context parallelism: older keys stay valid)."""
    cp = f".cp{ps.cp_rank}" if ps.cp_size > 1 else ""
    return f"rng.tp{ps.tp_rank}.pp{ps.pp_rank}.dp{ps.dp_rank}{cp}"


def _layout(tp: int, pp: int, dp: int, ep: int, cp: int = 1) -> dict[str, int]:
    """``common.pt``'s ``layout``: RNG states are restored only at the same one."""
    return {"tp": tp, "pp": pp, "dp": dp, "ep": ep, "cp": cp}


def _layout_of(ps: ParallelState) -> dict[str, int]:
    return _layout(ps.tp_size, ps.pp_size, ps.dp_size, ps.ep_size, ps.cp_size)


# --------------------------------------------------------------------------------------------------
# Planners: DCP's default ones, taught that one key may have several pieces on a rank
# --------------------------------------------------------------------------------------------------


def _piece_at(value: GlobalPieces, offset: torch.Size) -> torch.Tensor:
    for offsets, tensor in value.pieces:
        if torch.Size(offsets) == offset:
            return tensor
    raise KeyError(f"no piece at offset {tuple(offset)}")


class _SavePlanner(DefaultSavePlanner):
    """Writes a :class:`GlobalPieces` as one DCP shard per piece and anything else as bytes."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_local_plan(self) -> SavePlan:
        items = []
        for key, value in self.state_dict.items():
            if not isinstance(value, GlobalPieces):
                items.append(WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO))
                continue
            for offsets, tensor in value.pieces:
                offset = torch.Size(offsets)
                items.append(WriteItem(
                    index=MetadataIndex(key, offset), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offset, sizes=tensor.size()),
                                                properties=TensorProperties.create_from_tensor(tensor),
                                                size=torch.Size(value.global_shape)),
                ))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        value = self.state_dict[index.fqn]
        return _piece_at(value, index.offset) if isinstance(value, GlobalPieces) else value


class _LoadPlanner(DefaultLoadPlanner):
    """Reads into the pieces of a :class:`GlobalPieces` in place; bytes with ``weights_only`` (no pickle)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Any = None, is_coordinator: bool = False) -> None:
        # The default one walks the state dict to materialize meta tensors and drops objects it does not know.
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        requests = []
        for key, value in self.state_dict.items():
            saved = self.metadata.state_dict_metadata[key]
            if isinstance(value, GlobalPieces):
                chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.size()) for o, t in value.pieces]
                requests += create_read_items_for_chunk_list(key, saved, chunks)
            else:
                requests.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex(key),
                                         dest_offsets=torch.Size((0,)), storage_index=MetadataIndex(key),
                                         storage_offsets=torch.Size((0,)), lengths=torch.Size((0,))))
        return LoadPlan(requests)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return _piece_at(self.state_dict[index.fqn], index.offset)

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)  # UnpicklingError: _one_line




@contextlib.contextmanager
def _process_group_or_none() -> Iterator[bool]:
    """Yields DCP's ``no_dist``: True in a single-process run, where DCP's warning that it runs without a
    process group says what we asked for and is silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield not comm.is_initialized()


def _dcp_save(state: dict[str, Any], path: str, group: comm.Group = None, alone: bool = False) -> None:
    """DCP's save of ``state`` into iteration directory ``path``; a failed write on any rank is the same one-line
    CheckpointError on every rank (DCP gathers every rank's result). ``alone``: written by this process only
    (also inside a distributed run)."""
    with _process_group_or_none() as no_dist, ckpt.checksummed_saves():
        no_dist = no_dist or alone
        try:
            dcp.save(state, storage_writer=FileSystemWriter(path), planner=_SavePlanner(), no_dist=no_dist,
                     process_group=group)
        except CheckpointException as error:
            rank, (failure, _) = min(error.failures.items())
            raise ckpt.CheckpointError(f"writing checkpoint {path} failed on rank {rank}: {type(failure).__name__}: "
                                       f"{failure}; the tracker still names the previous checkpoint") from None


# What a failed read raises beyond CheckpointError: DCP's wrapper of every rank's errors, or (single process)
# what its planner and reader raise on data that does not fit.
_READ_ERRORS = (CheckpointException, KeyError, ValueError, RuntimeError, OSError, EOFError, pickle.UnpicklingError,
                AssertionError)


def _dcp_load(state: dict[str, Any], path: str, metadata: Any = None, no_dist: bool | None = None) -> DirectReader:
    """Read ``state`` (``GlobalPieces`` in place, None for plain values) from iteration directory ``path``,
    whose vetted index is ``metadata`` (default: read here); returns the reader (its counts of items read
    directly and through DCP's reader). ``no_dist``: read in this process alone (default: when there is no
    process group). A failure on any rank is the same one-line CheckpointError on every rank (DCP gathers them)."""
    reader = DirectReader(path, read_dcp_metadata(path) if metadata is None else metadata)
    twins = _set_twins_apart(state)
    with _process_group_or_none() as alone:
        no_dist = alone if no_dist is None else no_dist
        try:
            dcp.load(state, storage_reader=reader, planner=_LoadPlanner(), no_dist=no_dist)
        except ckpt.CheckpointError:
            raise
        except _READ_ERRORS as error:
            raise _one_line(error, path) from None
    for source, twin in twins:
        twin.copy_(source)
    return reader


def _set_twins_apart(state: dict[str, Any]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Drop from ``state``'s pieces each second piece of a key at the same offset and size (the tied embedding's
    copy on the rank that holds the original: the V placement's rank 0); return (read piece, its twin) pairs
    to copy after the read. DCP reads one piece per key and offset."""
    twins = []
    for value in state.values():
        if not isinstance(value, GlobalPieces):
            continue
        first: dict[tuple, torch.Tensor] = {}
        kept = []
        for offsets, tensor in value.pieces:
            box = (tuple(offsets), tuple(tensor.shape))
            if box in first:
                twins.append((first[box], tensor))
            else:
                first[box] = tensor
                kept.append((offsets, tensor))
        value.pieces = kept
    return twins


def _one_line(error: BaseException, path: str) -> ckpt.CheckpointError:
    """A failed DCP read as one line: the lowest failing rank's CheckpointError, or the error's first line."""
    rank = None
    if isinstance(error, CheckpointException) and error.failures:
        rank, (error, _) = min(error.failures.items())
        if isinstance(error, ckpt.CheckpointError):
            return ckpt.CheckpointError(str(error))
    if isinstance(error, pickle.UnpicklingError):  # weights-only loading met an object it will not build
        return ckpt.CheckpointError(f"checkpoint {path} is refused: a piece's pickle holds objects other than tensors, "
                                    "numbers and strings; this code never writes that, so the file is not one of its "
                                    "checkpoints (or was tampered with)")
    text = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
    where = f" on rank {rank}" if rank is not None else ""
    return ckpt.CheckpointError(f"reading checkpoint {path} failed{where}: {type(error).__name__}: {text}; {EARLIER}")


# --------------------------------------------------------------------------------------------------
# Save
# --------------------------------------------------------------------------------------------------


class _AsyncWrite:
    """The one checkpoint save running in the background (``--async-save``), and its error if it failed."""

    group: comm.Group = None  # a second process group: DCP's collectives there do not meet training's
    group_made = False
    thread: threading.Thread | None = None
    staged: threading.Event | None = None  # set once the thread has copied the state (or failed to)
    error: BaseException | None = None
    # The host copies of the last save, reused by the next one of the same shapes: a steady-state save
    # pays one memcpy into memory already touched, not the page faults of gigabytes of fresh memory.
    buffers: dict[str, GlobalPieces] = {}


before_async_staging: Callable[[], None] | None = None
"""Tests set this to run in the background thread before it copies the state (e.g. to wait for a step)."""
before_async_write: Callable[[], None] | None = None
"""Tests set this to run in the background thread between the copy and the write."""


def wait_for_async_staging() -> None:
    """Block until the background save (if any) has copied the parameters and optimizer state.

    ``train_step`` calls it right before the optimizer step, the first thing after a save that changes
    them in place; the copy thus overlaps the next iteration's forward and backward. Errors of the
    copy are raised by :func:`wait_for_async_save`."""
    if _AsyncWrite.staged is not None:
        with saving("waiting for the background checkpoint save to copy the state"):
            _AsyncWrite.staged.wait()
        _AsyncWrite.staged = None


def writing() -> bool:
    """Whether a background save is still running (not yet complete and named by the tracker)."""
    return _AsyncWrite.thread is not None and _AsyncWrite.thread.is_alive()


def background_save_failed() -> bool:
    """Whether this rank's background save ended with an error (the training loop then stops on every rank)."""
    return _AsyncWrite.error is not None and not writing()


def wait_for_async_save(ps: ParallelState) -> None:
    """Block until the background save (if any) is complete and named by the tracker; when it failed on any rank,
    every rank raises the same one-line CheckpointError.

    Called before the next save and at the end of training (by every rank)."""
    thread = _AsyncWrite.thread
    if thread is None:
        return
    with saving("waiting for the background checkpoint save to finish"):
        thread.join()
    _AsyncWrite.thread = _AsyncWrite.staged = None
    error, _AsyncWrite.error = _AsyncWrite.error, None
    if error is not None:
        _AsyncWrite.buffers = {}  # a failed copy may have left them half-written or mis-shaped
    # Rank 0 wrote the tracker in its thread: every rank returns only after that (or fails with the same line).
    if error is not None and not isinstance(error, ckpt.CheckpointError):  # agreed already when it is one
        error = f"the background checkpoint save failed on rank {ps.rank}: {type(error).__name__}: {error}"
    ckpt.raise_agreed(None if error is None else str(error), ps)


def _staging_buffers(pieces: dict[str, GlobalPieces]) -> dict[str, GlobalPieces]:
    """Host tensors to copy ``pieces`` into: the previous save's when every key, offset, shape and dtype
    matches (the usual case: the same run saving again), otherwise new ones (allocated, not yet touched).

    One tensor per piece, not views of one buffer: DCP's writer clones a view that does not span its
    whole storage before writing it."""
    def signature(state: dict[str, GlobalPieces]) -> list:
        return [(k, [(o, t.shape, t.dtype) for o, t in v.pieces]) for k, v in state.items()]

    if signature(_AsyncWrite.buffers) != signature(pieces):
        _AsyncWrite.buffers = {}  # freed before the new ones are allocated
        _AsyncWrite.buffers = {
            k: GlobalPieces(v.global_shape, [(o, torch.empty(t.shape, dtype=t.dtype, device="cpu"))
                                             for o, t in v.pieces]) for k, v in pieces.items()}
    return _AsyncWrite.buffers


def _copy_pieces(source: dict[str, GlobalPieces], target: dict[str, GlobalPieces]) -> None:
    for key, value in source.items():
        for (_, src), (_, dst) in zip(value.pieces, target[key].pieces):
            dst.copy_(src.detach())


def save_dist_checkpoint(root: str, iteration: int, config: Config, ps: ParallelState, model: list[nn.Module],
                         optimizer: Any, scheduler: Any, consumed_samples: int) -> str:
    """Save ``iteration`` in the torch_dist format; all ranks call it together. Returns the iteration directory.

    The parameters need not be gathered at ZeRO-3: every rank writes from its persistent shards. Rank 0
    names the checkpoint in the tracker only once DCP's save returned, i.e. once every rank's pieces and
    the index are on disk, so the tracker never names an incomplete checkpoint.

    With ``--async-save`` this returns at once: the small values (RNG states, buffers, scheduler, loss
    scaler) are copied here, the parameter and optimizer pieces by a background thread into reused host
    buffers, which then writes them. Until :func:`wait_for_async_staging` returns, nothing may change the
    parameters or the optimizer state in place (``train_step`` waits right before the optimizer step).
    """
    wait_for_async_save(ps)
    path = iteration_dir(root, iteration)
    os.makedirs(path, exist_ok=True)
    pieces: dict[str, GlobalPieces] = dict(model_save_pieces(model, ps, config.parallel.zero_stage))
    save_optim = optimizer is not None and config.checkpoint.save_optim
    if save_optim:
        pieces.update(optimizer_save_pieces(optimizer, model, ps))
    values: dict[str, Any] = {}
    if ps.tp_rank == 0 and ps.dp_cp_rank == 0:
        values.update({key: buffer.detach().cpu() for key, buffer in model_buffers(model).items()})
    values[_rng_key(ps)] = ckpt.rng_state()
    common = {
        "iteration": iteration, "consumed_samples": consumed_samples, "config": config.to_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "optimizer": {"step": optimizer_step(optimizer),
                      "loss_scaler": optimizer.scaler.state_dict() if optimizer.scaler is not None else None}
        if save_optim else None,
        "layout": _layout_of(ps),
    }

    def write(state: dict[str, Any], group: comm.Group, staging_failure: str | None = None) -> None:
        failure = staging_failure
        try:
            save_faults(iteration, ps.rank, watchdog_limit())
        except OSError as error:
            failure = failure or ckpt.save_failure(iteration, ps.rank, error)
        ckpt.raise_agreed(failure, ps, group)  # before DCP's collectives, which a failed rank would not join
        _dcp_save(state, path, group)  # DCP agrees on a failed write itself
        if ps.rank == 0:  # DCP's save returns once every rank's pieces and the index are written
            try:
                ckpt.save_atomically(os.path.join(path, COMMON_FILE), common)
                ckpt.write_tracker(root, iteration)
            except OSError as error:
                failure = ckpt.save_failure(iteration, ps.rank, error)
            else:
                retain_after_save(root, iteration, config.checkpoint.keep_last_checkpoints,
                                  config.checkpoint.keep_checkpoint_every)
                if config.checkpoint.async_save:  # the loop printed when it started
                    print(f" > saved checkpoint at iteration {iteration} to {root}", flush=True)
        ckpt.raise_agreed(failure, ps, group)  # every rank returns once the tracker names the new checkpoint

    if not config.checkpoint.async_save:
        write({**pieces, **values}, None)
        return path
    if not _AsyncWrite.group_made:
        _AsyncWrite.group, _AsyncWrite.group_made = comm.new_world_group(), True
    # Buffers (a QAT range changes in every forward) and the rest are small: copied before training goes on.
    values, common = copy.deepcopy(values), copy.deepcopy(common)
    buffers = _staging_buffers(pieces)
    staged = _AsyncWrite.staged = threading.Event()

    def background() -> None:
        try:
            failure = None
            try:
                if before_async_staging is not None:
                    before_async_staging()
                _copy_pieces(pieces, buffers)
            except Exception as error:  # noqa: BLE001 - agreed with the other ranks, then raised by every one
                failure = (f"copying the checkpoint of iteration {iteration} to host memory failed on rank "
                           f"{ps.rank}: {type(error).__name__}: {error}")
            finally:
                staged.set()  # also on failure: training must not wait forever, the error comes at the next wait
            if before_async_write is not None:
                before_async_write()
            write({**buffers, **values}, _AsyncWrite.group, failure)
        except BaseException as error:  # noqa: BLE001 - handed to the training thread by wait_for_async_save
            _AsyncWrite.error = error

    _AsyncWrite.thread = threading.Thread(target=background, name="async-checkpoint-save", daemon=False)
    _AsyncWrite.thread.start()
    return path


# --------------------------------------------------------------------------------------------------
# Load
# --------------------------------------------------------------------------------------------------


def _vocab_multiples(saved_config: dict, config: Config) -> tuple[int, int]:
    """(saved, this run's) multiple the vocabulary rows are padded to: --make-vocab-size-divisible-by * tp."""
    saved_model, saved_parallel = saved_config.get("model", {}), saved_config.get("parallel", {})
    saved = saved_model.get("make_vocab_size_divisible_by", 128) * saved_parallel.get("tensor_model_parallel_size", 1)
    return saved, config.model.make_vocab_size_divisible_by * config.parallel.tensor_model_parallel_size


def _check_vocab_rows(key: str, saved_rows: int, own_rows: int, multiples: tuple[int, int], path: str) -> None:
    """Refuse a vocabulary other than the saved one. The rows differ legitimately only by padding (another tp
    pads to another multiple): some real vocabulary size must pad to both row counts, as the torch format
    at its one layout requires equal rows."""
    saved_multiple, own_multiple = multiples
    lowest = max(saved_rows - saved_multiple, own_rows - own_multiple) + 1
    if lowest > min(saved_rows, own_rows):
        raise ckpt.CheckpointError(
            f"checkpoint {path} holds {key} with {saved_rows} rows (a vocabulary of {saved_rows - saved_multiple + 1}"
            f" to {saved_rows} tokens, padded to a multiple of {saved_multiple}), this model has {own_rows} (a "
            f"vocabulary of {own_rows - own_multiple + 1} to {own_rows}): a different vocabulary; pass the "
            "checkpoint's --vocab-size or tokenizer")


def fit_to_saved(pieces: dict[str, GlobalPieces], shapes: dict[str, tuple[int, ...]], path: str,
                  multiples: tuple[int, int]) -> None:
    """Check every key against the checkpoint; trim the vocabulary rows another tp's padding does not have."""
    for key, entry in pieces.items():
        if key not in shapes:
            raise ckpt.CheckpointError(f"checkpoint {path} has no {key!r} (saved from a different model?)")
        saved, own = shapes[key], entry.global_shape
        vocab = key.endswith(VOCAB_PARAMS) and saved[1:] == own[1:]
        if saved != own and not vocab:
            raise ckpt.CheckpointError(f"checkpoint {path} holds {key} of shape {list(saved)}, this model's is "
                                       f"{list(own)}: a different model")
        if vocab:
            _check_vocab_rows(key, saved[0], own[0], multiples, path)
        entry.pieces = clip_to(entry.pieces, saved)


def _tensor_shapes(metadata: Any) -> dict[str, tuple[int, ...]]:
    """``{key: global shape}`` of every tensor of a DCP index."""
    return {k: tuple(m.size) for k, m in metadata.state_dict_metadata.items()
            if not isinstance(m, BytesStorageMetadata)}


def open_dist_checkpoint(path: str, config: Config | None = None) -> tuple[dict, Any]:
    """``common.pt`` and the vetted DCP index of the torch_dist iteration directory ``path``, after checking
    both and the existence and length of every ``.distcp`` file (``checkpoint_integrity.py``); with
    ``config``, also that the saved model shape and architecture are this run's. One-line CheckpointErrors."""
    from megatron_like.training.checkpoint_validation import read_checkpoint_file  # it imports this module

    common_path = os.path.join(path, COMMON_FILE)
    if not os.path.exists(common_path):
        raise ckpt.CheckpointError(f"checkpoint file {common_path} is missing (an interrupted save?); {EARLIER}")
    common = read_checkpoint_file(common_path)
    if config is not None:
        ckpt.check_same_model(common, config, path)
    metadata = read_dcp_metadata(path)
    check_storage_files(path, metadata)
    return common, metadata


def check_dist_checkpoint(path: str, config: Config, ps: ParallelState, model: list[nn.Module]) -> None:
    """What :func:`load_dist_checkpoint` checks before it reads, without reading: for validation on every rank."""
    common, metadata = open_dist_checkpoint(path, config)
    shapes = {key: GlobalPieces(entry.global_shape) for key, entry in model_load_pieces(model, ps).items()}
    fit_to_saved(shapes, _tensor_shapes(metadata), path, _vocab_multiples(common["config"], config))


def load_dist_checkpoint(root: str, iteration: int, config: Config, ps: ParallelState, model: list[nn.Module],
                         optimizer: Any, scheduler: Any) -> tuple[int, int]:
    """Load a torch_dist checkpoint at this run's layout; returns (iteration, consumed samples).

    The model must hold full parameters (at ZeRO-3, call it inside ``gathered_parameters(model,
    write_back=True)``). ``--finetune`` reads the weights only and returns (0, 0).
    """
    path = iteration_dir(root, iteration)
    common, index = open_dist_checkpoint(path, config)
    metadata = index.state_dict_metadata
    shapes = _tensor_shapes(index)
    notice = resume_notice(common["config"], common.get("scheduler"), config, scheduler is not None)  # or refuse
    if notice and ps.rank == 0:
        print(notice, flush=True)
    multiples = _vocab_multiples(common["config"], config)
    weights_only = config.checkpoint.finetune

    # Parameters. An fp32 run's params are its masters: take the fp32 masters when the checkpoint has them.
    params = model_load_pieces(model, ps)
    fp32_params = all(p.dtype == torch.float32 for chunk in model for p in chunk.parameters())
    if fp32_params:
        params = {(MASTER_PREFIX + k[len("model."):] if MASTER_PREFIX + k[len("model."):] in shapes else k): v
                  for k, v in params.items()}
    state: dict[str, Any] = dict(params)
    # Buffers the checkpoint lacks (a float model's checkpoint loaded by a QAT run) keep their initial value.
    buffers = {key: buffer for key, buffer in model_buffers(model).items() if key in metadata}
    state.update(dict.fromkeys(buffers))

    saved_optim = common.get("optimizer")
    load_optim = optimizer is not None and config.checkpoint.load_optim and not weights_only
    install = None
    second_read: dict[str, Any] = {}
    has_masters = any(k.startswith(MASTER_PREFIX) for k in shapes)
    # Decided alike on every rank (same dtype and devices everywhere): DCP's load is collective.
    masters_from_params = load_optim and not has_masters and not all(optimizer.master_is_param)
    if load_optim:
        with_moments = saved_optim is not None and saved_optim["step"] is not None
        # Separate masters read `model.<name>` when the checkpoint has no masters (an fp32 run's); this rank
        # already reads that key into its params, and one key is read once per call: a second read then.
        pieces, install = optimizer_load_pieces(optimizer, model, ps, MASTER_PREFIX if has_masters else "model.",
                                                with_moments)
        for key, entry in pieces.items():
            (second_read if key in state else state)[key] = entry
    # Checkpoints from before expert / context parallelism: ep 1, cp 1.
    layout = {"ep": 1, "cp": 1, **common.get("layout", {})}
    same_layout = layout == _layout_of(ps)
    rng_key = _rng_key(ps)
    load_rng = config.checkpoint.load_rng and not weights_only and same_layout and rng_key in metadata
    if load_rng:
        state[rng_key] = None

    fit_to_saved({k: v for k, v in state.items() if isinstance(v, GlobalPieces)}, shapes, path, multiples)
    fit_to_saved(second_read, shapes, path, multiples)
    _dcp_load(state, path, index)
    if masters_from_params:  # every rank takes part, also one with nothing to read
        _dcp_load(second_read, path, index)
    for key, buffer in buffers.items():
        buffer.copy_(state[key])
    if weights_only:
        return 0, 0
    if install is not None:
        install(saved_optim["step"] if saved_optim else None)
        if saved_optim and saved_optim["loss_scaler"] is not None and optimizer.scaler is not None:
            optimizer.scaler.load_state_dict(saved_optim["loss_scaler"])
    if scheduler is not None and common["scheduler"] is not None:
        scheduler.load_state_dict(common["scheduler"])
    if load_rng:
        ckpt.set_rng_state(state[rng_key])
    elif config.checkpoint.load_rng and ps.rank == 0 and not same_layout:
        print(f" > checkpoint saved at tp {layout.get('tp')} x pp {layout.get('pp')} x dp {layout.get('dp')} "
              f"(ep {layout['ep']}, cp {layout['cp']}): "
              "its RNG states belong to that layout; the generators stay seeded from --seed", flush=True)
    return common["iteration"], common["consumed_samples"]


def save_full_state(root: str, iteration: int, config: Config, full: dict[str, torch.Tensor],
                    extra: dict[str, Any] | None = None) -> str:
    """Write whole single-process tensors as a torch_dist checkpoint in this one process (no process group:
    a tool's). ``full``: ``{model.<name> or optimizer.<kind>.<name>: global tensor}``; ``extra``: what
    ``common.pt`` holds beyond the iteration, config and layout (consumed samples, scheduler, optimizer step).
    Returns the iteration directory; the tracker names it last."""
    path = iteration_dir(root, iteration)
    write_global_state(path, full)
    p = config.parallel
    dp = config.world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size)
    common = {"iteration": iteration, "consumed_samples": 0, "config": config.to_dict(), "scheduler": None,
              "optimizer": None, "layout": _layout(p.tensor_model_parallel_size, p.pipeline_model_parallel_size, dp,
                                                   p.expert_model_parallel_size)}
    common.update(extra or {})
    ckpt.save_atomically(os.path.join(path, COMMON_FILE), common)
    ckpt.write_tracker(root, iteration)
    return path


def write_global_state(path: str, state: dict[str, Any]) -> None:
    """Write whole tensors (each one piece at offset 0) and plain values (bytes) as a DCP checkpoint into
    directory ``path``, in this one process (also one rank of a distributed run)."""
    os.makedirs(path, exist_ok=True)
    _dcp_save({k: GlobalPieces(tuple(t.shape), [((0,) * t.ndim, t)]) if isinstance(t, torch.Tensor) and t.ndim
               else t.clone() if isinstance(t, torch.Tensor) else t for k, t in state.items()}, path, alone=True)


def read_full_tensors(root: str, keys: list[str], iteration: int | None = None) -> dict[str, torch.Tensor]:
    """Whole global tensors of a torch_dist checkpoint, read in this one process (no process group needed:
    call it outside a distributed run, e.g. in a tool or a test). Default: the latest iteration."""
    iteration = ckpt.latest_iteration(root) if iteration is None else iteration
    path = iteration_dir(root, iteration)
    index = read_dcp_metadata(path)
    check_storage_files(path, index)
    metadata = index.state_dict_metadata
    missing = [k for k in keys if k not in metadata]
    if missing:
        raise ckpt.CheckpointError(f"checkpoint {path} has no {', '.join(missing)}")
    out = {k: torch.empty(tuple(metadata[k].size), dtype=metadata[k].properties.dtype) for k in keys
           if not isinstance(metadata[k], BytesStorageMetadata)}
    state: dict[str, Any] = {k: GlobalPieces(tuple(t.shape), [((0,) * t.ndim, t)]) for k, t in out.items()}
    state.update({k: None for k in keys if k not in out})  # plain values (buffers) are read whole
    _dcp_load(state, path, index, no_dist=True)
    return {k: out[k] if k in out else state[k] for k in keys}


def model_keys(path: str) -> list[str]:
    """The ``model.<name>`` keys of the torch_dist checkpoint in iteration directory ``path``."""
    return sorted(k for k in read_dcp_metadata(path).state_dict_metadata if k.startswith("model."))
