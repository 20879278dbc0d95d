"""Checkpoints that resume exactly (docs/design.md §5).

Layout of one checkpoint (``TT`` = tp rank, ``PPP`` = pp rank, ``DDD`` = dp rank)::

    <root>/latest_checkpointed_iteration.txt              last, atomically, by rank 0
    <root>/iter_0000100/mp_rank_TT_PPP/model_optim_rng.pt  data-parallel rank 0 of each (tp, pp) position
    <root>/iter_0000100/mp_rank_TT_PPP/optim_rng_dp_DDD.pt every other data-parallel rank (DDD >= 1)

With expert parallelism (``--expert-model-parallel-size`` > 1, MoE) the directories are Megatron-LM's
``mp_rank_TT_PPP_EEE`` (``EEE`` = ep rank: each holds its own experts) and ``DDD`` counts the ranks holding the
same experts (the expert-data-parallel rank, ``dp_rank // ep``).

``model_optim_rng.pt`` holds ``iteration``, ``consumed_samples`` (the data iterator's position: the
samplers are deterministic in it), ``config`` (the args), ``model`` (one state dict per virtual stage,
full tensors also at ZeRO-3), ``optimizer`` (this rank's ZeRO shard, or the whole replicated state
without ZeRO), ``scheduler`` and ``rng`` (python, numpy, torch and the tensor-parallel tracker).
``optim_rng_dp_DDD.pt`` holds the ``rng`` of data-parallel rank DDD and, with ZeRO 1-3, its
``optimizer`` shard: every rank's generators and shards are saved, so a resume is bitwise exact.

Crash safety: every file is written under a temporary name, fsynced and renamed; ranks then meet at a
barrier and only afterwards rank 0 replaces the tracker the same way. A save killed at any point leaves
the previous tracker pointing at a complete checkpoint. Loading uses ``torch.load(weights_only=True)``:
tensors, numbers, strings and containers only, never arbitrary pickle, after checking the CRC-32 that
torch.save wrote for every record (``checkpoint_integrity.py``).
"""

from __future__ import annotations

import contextlib
import os
import random
import warnings
from collections.abc import Callable, Iterator
from typing import IO, Any

import numpy as np
import torch
from torch import nn

from megatron_like import collectives as comm
from megatron_like.config import Config
from megatron_like.config.compare import refused_model_change
from megatron_like.parallel_state import ParallelState
from megatron_like.tensor_parallel import get_rng_tracker
from megatron_like.training.fault_injection import save_faults
from megatron_like.training.resume import resume_notice
from megatron_like.training.retention import retain_after_save
from megatron_like.training.signals import watchdog_limit

TRACKER_FILE = "latest_checkpointed_iteration.txt"
MODEL_FILE = "model_optim_rng.pt"
RESHARD_HINT = "convert it with tools/checkpoint_reshard.py"
MISSING_HINT = f"saved with another --tensor/--pipeline/--expert-model-parallel-size? {RESHARD_HINT}"

FaultHook = Callable[[str], None]
fault_hook: FaultHook | None = None
"""Tests set this to a function called at every point where a save could be interrupted
(``"open"``, ``"written"``, ``"renamed"``, ``"tracker"``); raising in it simulates a crash there."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used with this run; the message says why and what to do."""


def _fault(point: str) -> None:
    if fault_hook is not None:
        fault_hook(point)


def shard_dir_name(tp_rank: int, pp_rank: int, ep_rank: int = 0, ep_size: int = 1) -> str:
    """``mp_rank_TT_PPP``, or ``mp_rank_TT_PPP_EEE`` under expert parallelism (Megatron-LM's names)."""
    return f"mp_rank_{tp_rank:02d}_{pp_rank:03d}" + (f"_{ep_rank:03d}" if ep_size > 1 else "")


def checkpoint_dir(root: str, iteration: int, ps: ParallelState) -> str:
    """``<root>/iter_XXXXXXX/mp_rank_TT_PPP(_EEE)``: the directory of this rank's (tp, pp, ep) position."""
    return os.path.join(root, f"iter_{iteration:07d}", shard_dir_name(ps.tp_rank, ps.pp_rank, ps.ep_rank, ps.ep_size))


def replica_rank(ps: ParallelState) -> int:
    """This rank's index among the ranks holding the same model files: the dp rank, or under expert
    parallelism the expert-dp rank (``dp_rank // ep``; equal to the dp rank at ep 1)."""
    return ps.expert_dp_rank


def rank_file(directory: str, dp_rank: int) -> str:
    """The file data-parallel rank ``dp_rank`` writes inside its ``mp_rank_TT_PPP`` directory."""
    return os.path.join(directory, MODEL_FILE if dp_rank == 0 else f"optim_rng_dp_{dp_rank:03d}.pt")


TEMPORARY_MARK = ".megatron_like-tmp."
"""In the name of every temporary file this code writes (``<file>.megatron_like-tmp.<pid>``): the lock's cleanup
removes these and nothing else (job_lock.py)."""


def write_atomically(path: str, write: Callable[[IO[bytes]], None]) -> None:
    """Write ``path`` through a temporary file, fsync it, then rename it over ``path`` (all or nothing)."""
    tmp = f"{path}{TEMPORARY_MARK}{os.getpid()}"
    _fault("open")
    with open(tmp, "wb") as f:
        write(f)
        _fault("written")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    # The rename itself must reach the disk before anything that depends on it (the tracker).
    directory = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    _fault("renamed")


@contextlib.contextmanager
def checksummed_saves(on: bool = True) -> Iterator[None]:
    """torch.save writes the CRC-32 of every record of its archive (its default, forced on here): the
    checksums every load verifies (``checkpoint_integrity.py``). ``on=False`` writes them as zeros, as an archive
    saved without them (benchmarks/checkpoint_verify.py measures the difference)."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(on)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


def save_atomically(path: str, state: dict[str, Any]) -> None:
    """``torch.save(state)`` to ``path`` through :func:`write_atomically`, every record with its CRC-32."""
    with checksummed_saves():
        write_atomically(path, lambda f: torch.save(state, f))


def rng_state() -> dict[str, Any]:
    """This rank's generators, as plain tensors and numbers (safe for ``weights_only`` loading)."""
    np_state = np.random.get_state()
    python_state = random.getstate()
    state = {
        "python": list(python_state[1]),
        "python_pos": python_state[2],
        "numpy_keys": torch.from_numpy(np_state[1].astype(np.int64)),
        "numpy_pos": int(np_state[2]),
        "torch": torch.get_rng_state(),
        "tracker": get_rng_tracker().get_states(),
        "tracker_device": get_rng_tracker().device_type,
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore :func:`rng_state`'s output.

    Generator states must be CPU byte tensors (also for ``torch.cuda.set_rng_state``) and numpy's keys
    need host memory; ``load_checkpoint`` reads to the CPU, and a state that was moved to a device is
    brought back first.
    """
    state = {key: value.cpu() if isinstance(value, torch.Tensor) else value for key, value in state.items()}
    state["tracker"] = {name: value.cpu() for name, value in state["tracker"].items()}
    random.setstate((3, tuple(state["python"]), state["python_pos"]))
    np.random.set_state(("MT19937", state["numpy_keys"].numpy().astype(np.uint32), state["numpy_pos"], 0, 0.0))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tracker = get_rng_tracker()
    saved_on = state.get("tracker_device", "cpu")
    if saved_on == tracker.device_type:
        tracker.set_states(state["tracker"])
    else:  # a CPU generator state is no CUDA one: the run keeps its freshly seeded dropout streams
        warnings.warn(f"checkpoint RNG states were saved on {saved_on}, this run is on {tracker.device_type}: "
                      "tensor-parallel dropout streams restart from --seed (training continues, not bitwise)",
                      stacklevel=2)


def optimizer_is_sharded(optimizer: Any) -> bool:
    """True when each data-parallel rank holds a different part of the optimizer state (ZeRO 1-3)."""
    return bool(getattr(optimizer, "sharded", False))


def save_checkpoint(root: str, iteration: int, config: Config, ps: ParallelState, model: list[nn.Module],
                    optimizer: Any, scheduler: Any, consumed_samples: int) -> str:
    """Save this rank's part of the checkpoint of ``iteration``; returns its ``mp_rank`` directory.

    Every rank writes one file (see the module docstring); all ranks must call this together. The model
    must hold full parameters (at ZeRO-3, call it inside ``gathered_parameters(model)``).
    ``--ckpt-format torch_dist`` saves through ``dist_checkpointing.py`` instead (no gathering needed).
    """
    if config.checkpoint.ckpt_naming == "megatron":
        from megatron_like.training.megatron_export import save_in_megatron_naming  # it imports this module

        return save_in_megatron_naming(root, iteration, config, ps, model, optimizer, scheduler, consumed_samples)
    if config.checkpoint.ckpt_format == "torch_dist":
        from megatron_like.training import dist_checkpointing  # it imports this module

        return dist_checkpointing.save_dist_checkpoint(root, iteration, config, ps, model, optimizer, scheduler,
                                                       consumed_samples)
    path = checkpoint_dir(root, iteration, ps)
    os.makedirs(path, exist_ok=True)
    save_optim = optimizer is not None and config.checkpoint.save_optim
    state: dict[str, Any] = {"iteration": iteration, "rng": rng_state()}
    replica = replica_rank(ps)
    if save_optim and (replica == 0 or optimizer_is_sharded(optimizer)):
        state["optimizer"] = optimizer.state_dict()
    elif replica == 0:
        state["optimizer"] = None
    if replica == 0:
        state.update(
            consumed_samples=consumed_samples,
            config=config.to_dict(),
            model=[chunk.state_dict() for chunk in model],
            scheduler=scheduler.state_dict() if scheduler is not None else None,
            dp_size=ps.dp_size,
        )
    failure = None
    try:
        save_faults(iteration, ps.rank, watchdog_limit())
        save_atomically(rank_file(path, replica), state)
    except OSError as error:
        failure = save_failure(iteration, ps.rank, error)
    raise_agreed(failure, ps)  # every rank's file is in (or every rank stops with the same line)
    if ps.rank == 0:
        try:
            write_tracker(root, iteration)
        except OSError as error:
            failure = save_failure(iteration, ps.rank, error)
        else:
            retain_after_save(root, iteration, config.checkpoint.keep_last_checkpoints,
                              config.checkpoint.keep_checkpoint_every)
    raise_agreed(failure, ps)
    return path


def save_failure(iteration: int, rank: int, error: BaseException) -> str:
    """The one line every rank reports when ``rank`` failed to save ``iteration``."""
    return (f"saving the checkpoint of iteration {iteration} failed on rank {rank}: {type(error).__name__}: "
            f"{error}; the tracker still names the previous checkpoint")


def raise_agreed(failure: str | None, ps: ParallelState, group: comm.Group = None) -> None:
    """Meet every rank of ``group`` (default: all); when any of them passes a failure, every rank raises the
    lowest failing rank's as a CheckpointError (at once, not at the distributed timeout)."""
    group = comm.world_group() if group is None else group
    agreed = comm.first_error(failure, group, ps.device if group is comm.world_group() else "cpu")
    if agreed is not None:
        raise CheckpointError(agreed)


def write_tracker(root: str, iteration: int) -> None:
    """Name ``iteration`` in ``<root>/latest_checkpointed_iteration.txt`` (rank 0, once every rank's files are in)."""
    _fault("tracker")
    write_atomically(os.path.join(root, TRACKER_FILE), lambda f: f.write(f"{iteration}\n".encode()))


def read_tracker(tracker: str) -> int:
    """The iteration the tracker file ``tracker`` names; a one-line CheckpointError when it holds anything else."""
    try:
        with open(tracker, "rb") as f:
            raw = f.read(64)
    except OSError as error:
        raise CheckpointError(f"{tracker} cannot be read: {error.strerror or error}") from None
    text = raw.strip()
    if not (text.isascii() and text.isdigit()):
        shown = repr(text[:40].decode()) if text.isascii() else repr(text[:40])  # bytes that are no text: b'\xff'
        raise CheckpointError(f"{tracker} holds {shown}, not an iteration number; write the number of a "
                              "saved iteration into it (or delete it to start from scratch)")
    return int(text)


def latest_iteration(root: str) -> int | None:
    """The iteration ``<root>/latest_checkpointed_iteration.txt`` names (None when there is none)."""
    tracker = os.path.join(root, TRACKER_FILE)
    if not os.path.exists(tracker):
        return None
    return read_tracker(tracker)


DIST_COMMON_FILE = "common.pt"
"""torch_dist: the file of rank 0 with iteration, consumed samples, config, scheduler (dist_checkpointing.py)."""
DCP_METADATA = ".metadata"
"""torch_dist: torch.distributed.checkpoint's index of every saved piece."""


def iteration_dir(root: str, iteration: int) -> str:
    """``<root>/iter_XXXXXXX``: the directory of one saved iteration, in both formats."""
    return os.path.join(root, f"iter_{iteration:07d}")


def is_dist_checkpoint(root: str, iteration: int) -> bool:
    """Whether ``<root>/iter_XXXXXXX`` was saved with --ckpt-format torch_dist (it holds DCP's index)."""
    return os.path.exists(os.path.join(iteration_dir(root, iteration), DCP_METADATA))


def check_same_model(saved: dict, config: Config, path: str) -> None:
    """Refuse a checkpoint (its saved ``config``) whose model computes something else than this run's: every
    ModelConfig field declared MUST_MATCH, and FINETUNE_MAY_CHANGE unless --finetune (config/fields.py)."""
    problem = refused_model_change(saved["config"]["model"], config.model, config.checkpoint.finetune)
    if problem is not None:
        raise CheckpointError(f"checkpoint {path} {problem}")


def check_compatible(saved: dict, config: Config, path: str) -> None:
    """Refuse a checkpoint whose model shape or parallel layout differs from this run's flags."""
    check_same_model(saved, config, path)
    saved_parallel = saved["config"]["parallel"]
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size"):
        saved_value = saved_parallel.get(name, 1)  # checkpoints from before expert parallelism: ep 1
        if saved_value != getattr(config.parallel, name):
            flag = "--" + name.replace("_", "-")
            raise CheckpointError(
                f"checkpoint {path} was saved with {flag} {saved_value}, this run uses "
                f"{getattr(config.parallel, name)}; {RESHARD_HINT}"
            )
    if saved_parallel.get("num_layers_per_virtual_pipeline_stage") != \
            config.parallel.num_layers_per_virtual_pipeline_stage:
        raise CheckpointError(
            f"checkpoint {path} was saved with --num-layers-per-virtual-pipeline-stage "
            f"{saved_parallel.get('num_layers_per_virtual_pipeline_stage')}, this run uses "
            f"{config.parallel.num_layers_per_virtual_pipeline_stage}; {RESHARD_HINT}"
        )


def _check_optimizer_layout(saved: dict, config: Config, ps: ParallelState, optimizer: Any, path: str) -> None:
    """ZeRO shards only fit the same data-parallel size and an optimizer sharded the same way."""
    saved_parallel = saved["config"]["parallel"]
    saved_zero = saved_parallel.get("zero_stage", 0)
    saved_dp = saved.get("dp_size", ps.dp_size)
    saved_sharded = saved_zero >= 1 and saved_dp > 1
    if saved_sharded != optimizer_is_sharded(optimizer) or (saved_sharded and saved_dp != ps.dp_size):
        raise CheckpointError(
            f"checkpoint {path} holds optimizer state of --zero-stage {saved_zero} over {saved_dp} data-parallel "
            f"ranks; this run has --zero-stage {config.parallel.zero_stage} over {ps.dp_size}: {RESHARD_HINT} "
            "or pass --no-load-optim"
        )


def _read(path: str) -> dict:
    """torch.load(weights_only=True) to the CPU; failures are one-line CheckpointErrors naming ``path``."""
    from megatron_like.training.checkpoint_validation import read_checkpoint_file  # it imports this module

    return read_checkpoint_file(path)


def check_torch_format_expert_tp(root: str, ps: ParallelState) -> None:
    """Refuse a torch-format checkpoint at an expert tp other than tp: its files hold each expert cut over tp."""
    if ps.expert_tp_size != ps.tp_size:
        raise CheckpointError(f"--load {root} is a torch-format checkpoint, whose experts load only at "
                              f"--expert-tensor-parallel-size = --tensor-model-parallel-size ({ps.tp_size}), this run "
                              f"uses {ps.expert_tp_size}; resume it at etp {ps.tp_size} with --ckpt-format torch_dist "
                              "and load that checkpoint at any etp")


def load_checkpoint(root: str, config: Config, ps: ParallelState, model: list[nn.Module],
                    optimizer: Any, scheduler: Any) -> tuple[int, int]:
    """Load the latest checkpoint under ``root`` into this rank; returns (iteration, consumed samples).

    The model must hold full parameters (at ZeRO-3, call it inside ``gathered_parameters(model,
    write_back=True)``). With ``--finetune`` only the weights are read and (0, 0) is returned.
    Every byte read is checked against its checksum; when any rank finds a problem, every rank raises the
    same one-line CheckpointError (call on all ranks together, after ``validate_checkpoint``).
    """
    try:
        loaded, error = _load_checkpoint(root, config, ps, model, optimizer, scheduler), None
    except CheckpointError as problem:
        loaded, error = (0, 0), str(problem)
    agreed = comm.first_error(error, comm.world_group(), ps.device)
    if agreed is not None:
        raise CheckpointError(agreed)
    return loaded


def _load_checkpoint(root: str, config: Config, ps: ParallelState, model: list[nn.Module],
                     optimizer: Any, scheduler: Any) -> tuple[int, int]:
    iteration = latest_iteration(root)
    if iteration is None:
        raise CheckpointError(f"--load {root} holds no {TRACKER_FILE}; is it a checkpoint directory?")
    from megatron_like.training import megatron_load  # it imports this module

    kind = megatron_load.megatron_kind(iteration_dir(root, iteration))
    if kind is not None:  # Megatron-LM's own files, either format
        return megatron_load.load_megatron_checkpoint(iteration_dir(root, iteration), kind, config, ps, model,
                                                      optimizer, scheduler)
    if is_dist_checkpoint(root, iteration):  # either format loads, whatever --ckpt-format
        from megatron_like.training import dist_checkpointing  # it imports this module

        return dist_checkpointing.load_dist_checkpoint(root, iteration, config, ps, model, optimizer, scheduler)
    check_torch_format_expert_tp(root, ps)
    directory = checkpoint_dir(root, iteration, ps)
    path = rank_file(directory, 0)
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint file {path} is missing ({MISSING_HINT})")
    # Load to host memory, as Megatron does: load_state_dict copies weights to their device and casts
    # optimizer moments to their parameter's, while step counters and RNG states stay on the CPU where
    # torch expects them (a GPU `step` would make CPUAdam sync with the device once per parameter).
    state = _read(path)
    check_compatible(state, config, path)
    notice = resume_notice(state["config"], state.get("scheduler"), config, scheduler is not None)  # or refuse
    if notice and ps.rank == 0:
        print(notice, flush=True)
    for chunk, chunk_state in zip(model, state["model"]):
        chunk.load_state_dict(chunk_state)
    if config.checkpoint.finetune:
        return 0, 0
    own = state
    if replica_rank(ps) > 0:
        own_path = rank_file(directory, replica_rank(ps))
        if os.path.exists(own_path):
            own = _read(own_path)
        elif optimizer_is_sharded(optimizer) and config.checkpoint.load_optim:
            raise CheckpointError(f"checkpoint file {own_path} (this rank's ZeRO shard) is missing; {RESHARD_HINT}")
    if optimizer is not None and config.checkpoint.load_optim and state.get("optimizer") is not None:
        _check_optimizer_layout(state, config, ps, optimizer, path)
        optimizer.load_state_dict(own["optimizer"] if optimizer_is_sharded(optimizer) else state["optimizer"])
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
    if config.checkpoint.load_rng and "rng" in own:
        # A rank beyond the saved data-parallel size (dp grew) takes dp rank 0's generators; a resharded
        # checkpoint has none (the run keeps its freshly seeded ones).
        set_rng_state(own["rng"])
    return state["iteration"], state["consumed_samples"]
