"""Check a checkpoint before any rank loads or trains from it; every rank agrees on the verdict.

``validate_checkpoint`` runs on every rank after the model and optimizer are built and before
``load_checkpoint``. Each rank checks what it will read:

* the tracker ``latest_checkpointed_iteration.txt`` holds a number and names an existing ``iter_`` directory;
* this rank's files exist and open as ``torch.load(weights_only=True)`` archives (read with ``mmap``, so
  the tensors are not copied): a truncated or garbage file, an unreadable one and a pickle that holds
  anything but tensors, numbers, strings and containers (an "unsafe pickle") are refused;
* the saved model shape and parallel layout equal this run's (``check_compatible``), the saved
  tensors have this rank's names and shapes, and ZeRO optimizer shards fit the data-parallel layout;
* torch_dist: ``common.pt``, the DCP index (unpickled with an allow-list, storage names plain), every
  ``.distcp`` file it names (present, long enough) and this rank's keys and shapes, vocabulary included
  (``dist_checkpointing.check_dist_checkpoint``).

The checksums of every byte are verified by the load itself as it reads them (``checkpoint_integrity.py``);
``load_checkpoint`` and DCP make every rank agree on a failure there too.

Then the ranks agree (:func:`megatron_like.collectives.first_error`): if any rank found a problem, every
rank raises the same one-line :class:`CheckpointError` naming the file and the problem, so no rank
starts training while another one stops. The entry point prints it and exits with status 1.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import sys
import zipfile
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from megatron_like import collectives as comm
from megatron_like.config import Config
from megatron_like.parallel_state import ParallelState
from megatron_like.training.checkpoint_integrity import verify_archive
from megatron_like.training.checkpointing import (
    DCP_METADATA,
    MISSING_HINT,
    RESHARD_HINT,
    TRACKER_FILE,
    CheckpointError,
    _check_optimizer_layout,
    check_compatible,
    check_torch_format_expert_tp,
    checkpoint_dir,
    is_dist_checkpoint,
    latest_iteration,
    optimizer_is_sharded,
    rank_file,
    replica_rank,
)

_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def read_checkpoint_file(path: str, mmap: bool = False, verify: bool = True) -> dict[str, Any]:
    """``torch.load(path, weights_only=True)`` to the CPU; any failure is a one-line CheckpointError.

    ``verify``: first check every record against the CRC-32 it was saved with (a full read of the file;
    a file saved without checksums loads with a one-line notice). ``mmap=True`` maps the tensors instead
    of reading them: with ``verify=False`` a cheap check of the archive and pickle.
    """
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} is missing")
    try:  # torch.save writes a zip archive whose directory is at the end: a cut file has none
        with zipfile.ZipFile(path) as archive:
            archive.infolist()
    except zipfile.BadZipFile as error:
        raise CheckpointError(f"checkpoint file {path} is truncated or not a torch checkpoint ({error}); write "
                              f"an earlier saved iteration into {TRACKER_FILE}") from None
    except OSError as error:
        raise CheckpointError(f"checkpoint file {path} cannot be read: {error}") from None
    if verify and not verify_archive(path, path):
        print(f" > checkpoint file {path} was saved without checksums (CRC-32 off in torch.save): loaded without "
              "verifying its bytes", flush=True)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:  # weights-only loading met an object it will not build
        found = _GLOBAL.search(str(error))
        what = f"a reference to {found.group(1)}" if found else "objects other than tensors, numbers and strings"
        raise CheckpointError(f"checkpoint file {path} is refused: its pickle holds {what}; this code never "
                              "writes that, so the file is not one of its checkpoints (or was tampered with)") from None
    except (RuntimeError, EOFError, OSError, ValueError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if "zip archive" in first_line or "central directory" in first_line or isinstance(error, EOFError):
            raise CheckpointError(f"checkpoint file {path} is truncated or not a torch checkpoint "
                                  f"({first_line}); write an earlier saved iteration into {TRACKER_FILE}") from None
        raise CheckpointError(f"checkpoint file {path} cannot be read: {first_line}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint file {path} holds a {type(state).__name__}, not a checkpoint dict")
    return state


def _check_model_tensors(state: dict, model: list[nn.Module], path: str) -> None:
    """The saved chunk states have this rank's parameter names and shapes (shapes where the model holds data:
    a ZeRO-3 parameter is empty between uses)."""
    saved = state.get("model")
    if not isinstance(saved, list) or len(saved) != len(model):
        count = len(saved) if isinstance(saved, list) else "no"
        raise CheckpointError(f"checkpoint file {path} holds {count} model chunk(s), this run builds {len(model)}")
    for index, (chunk, chunk_state) in enumerate(zip(model, saved)):
        expected = chunk.state_dict()
        # Every parameter must be saved; buffers may be absent (e.g. QAT ranges when fine-tuning a float
        # checkpoint: the quantizers load nothing then), but nothing unknown may be present.
        parameters = {name for name, _ in chunk.named_parameters(remove_duplicate=False)} & set(expected)
        missing = sorted(parameters - set(chunk_state))
        extra = sorted(set(chunk_state) - set(expected))
        if missing or extra:
            names = ", ".join((["missing " + n for n in missing] + ["unexpected " + n for n in extra])[:3])
            raise CheckpointError(f"checkpoint file {path} chunk {index} does not fit this model: {names}")
        for name, tensor in expected.items():
            got = chunk_state.get(name)
            if tensor.numel() and isinstance(got, torch.Tensor) and got.shape != tensor.shape:
                raise CheckpointError(f"checkpoint file {path}: {name} has shape {tuple(got.shape)}, this model "
                                      f"has {tuple(tensor.shape)}")


def _problems(root: str, config: Config, ps: ParallelState, model: list[nn.Module], optimizer: Any) -> None:
    """Raise CheckpointError for the first problem of what this rank will load."""
    iteration = latest_iteration(root)
    if iteration is None:
        raise CheckpointError(f"--load {root} holds no {TRACKER_FILE}; is it a checkpoint directory?")
    iteration_dir = os.path.dirname(checkpoint_dir(root, iteration, ps))
    if not os.path.isdir(iteration_dir):
        raise CheckpointError(f"{os.path.join(root, TRACKER_FILE)} names iteration {iteration} but {iteration_dir} "
                              "does not exist; write the number of an existing iter_ directory into it")
    from megatron_like.training import megatron_load  # it imports this module

    kind = megatron_load.megatron_kind(iteration_dir)
    if kind is not None:  # a Megatron-LM checkpoint: its arguments against this run's; tensors checked as read
        megatron_load.check_megatron_checkpoint(megatron_load.open_megatron(iteration_dir, kind), config)
        return
    if is_dist_checkpoint(root, iteration):
        # torch_dist: common.pt, the index (unpickled with an allow-list), every .distcp file it names (exists,
        # long enough) and this rank's keys and shapes; the pieces' checksums are verified as they are read.
        from megatron_like.training.dist_checkpointing import check_dist_checkpoint  # imports DCP

        check_dist_checkpoint(iteration_dir, config, ps, model)
        return
    if any(name.endswith(".distcp") for name in os.listdir(iteration_dir)):
        raise CheckpointError(f"{iteration_dir} holds torch_dist pieces but no {DCP_METADATA} index (an interrupted "
                              f"save); write an earlier saved iteration into {TRACKER_FILE}")
    check_torch_format_expert_tp(root, ps)
    directory = checkpoint_dir(root, iteration, ps)
    path = rank_file(directory, 0)
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} is missing ({MISSING_HINT})")
    state = read_checkpoint_file(path, mmap=True, verify=False)  # the load verifies the checksums
    for key in ("iteration", "config", "model"):
        if key not in state:
            raise CheckpointError(f"checkpoint file {path} has no {key!r} entry; is it a model_optim_rng.pt?")
    check_compatible(state, config, path)
    _check_model_tensors(state, model, path)
    if config.checkpoint.finetune:
        return
    if replica_rank(ps) > 0:
        own_path = rank_file(directory, replica_rank(ps))
        if os.path.exists(own_path):
            read_checkpoint_file(own_path, mmap=True, verify=False)
        elif optimizer_is_sharded(optimizer) and config.checkpoint.load_optim:
            raise CheckpointError(f"checkpoint file {own_path} (this rank's ZeRO shard) is missing; {RESHARD_HINT}")
    if optimizer is not None and config.checkpoint.load_optim and state.get("optimizer") is not None:
        _check_optimizer_layout(state, config, ps, optimizer, path)


def validate_checkpoint(root: str, config: Config, ps: ParallelState, model: list[nn.Module],
                        optimizer: Any) -> None:
    """Check the latest checkpoint under ``root`` on every rank; raise the same CheckpointError on every
    rank when any rank found a problem (call on all ranks together)."""
    try:
        _problems(root, config, ps, model, optimizer)
        error = None
    except CheckpointError as problem:
        error = str(problem)
    agreed = comm.first_error(error, comm.world_group(), ps.device)
    if agreed is not None:
        raise CheckpointError(agreed)


@contextlib.contextmanager
def exit_on_checkpoint_error() -> Iterator[None]:
    """For entry points: a CheckpointError (agreed by every rank) or a CheckpointLoadError (a checkpoint
    directory every rank reads the same way, e.g. a fine-tune's pretrained GPT lacking a shard) prints
    ``error: ...`` on each rank and exits with status 1, after leaving the process group cleanly (no traceback)."""
    # Imported here: megatron_like.model.state imports this package's checkpointing module.
    from megatron_like.model.state import CheckpointLoadError

    try:
        yield
    except (CheckpointError, CheckpointLoadError) as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        comm.shutdown()
        raise SystemExit(1) from None
