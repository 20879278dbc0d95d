"""Checkpoints: ``<dir>/iter_0000100/mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt`` (DESIGN.md §5).

A save writes every file under a temporary name and renames it when complete; only then, after all
ranks are done, rank 0 rewrites ``latest_checkpointed_iteration.txt`` atomically. A save interrupted
anywhere leaves the previous checkpoint the latest one. Loading uses ``weights_only=True``: no
arbitrary pickle.
"""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch
from torch import nn

from megatron_like import collectives as comm
from megatron_like.config import Config
from megatron_like.parallel_state import ParallelState
from megatron_like.tensor_parallel import get_rng_tracker

TRACKER_FILE = "latest_checkpointed_iteration.txt"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used with this run; the message says why and what to do."""


def checkpoint_dir(root: str, iteration: int, ps: ParallelState) -> str:
    return os.path.join(root, f"iter_{iteration:07d}", f"mp_rank_{ps.tp_rank:02d}_{ps.pp_rank:03d}")


def _write_atomically(path: str, write) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def rng_state() -> dict[str, Any]:
    """This rank's generators, as plain tensors and numbers (safe for ``weights_only`` loading)."""
    np_state = np.random.get_state()
    return {
        "python": list(random.getstate()[1]),
        "python_pos": random.getstate()[2],
        "numpy_keys": torch.from_numpy(np_state[1].astype(np.int64)),
        "numpy_pos": int(np_state[2]),
        "torch": torch.get_rng_state(),
        "tracker": get_rng_tracker().get_states(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate((3, tuple(state["python"]), state["python_pos"]))
    np.random.set_state(("MT19937", state["numpy_keys"].numpy().astype(np.uint32), state["numpy_pos"], 0, 0.0))
    torch.set_rng_state(state["torch"])
    get_rng_tracker().set_states(state["tracker"])


def save_checkpoint(root: str, iteration: int, config: Config, ps: ParallelState, model: list[nn.Module],
                    optimizer: torch.optim.Optimizer | None, scheduler: Any, consumed_samples: int) -> str:
    """Save this rank's shard (data-parallel rank 0 writes; its replicas are identical)."""
    path = checkpoint_dir(root, iteration, ps)
    if ps.dp_rank == 0:
        os.makedirs(path, exist_ok=True)
        state = {
            "iteration": iteration,
            "consumed_samples": consumed_samples,
            "config": config.to_dict(),
            "model": [chunk.state_dict() for chunk in model],
            "optimizer": optimizer.state_dict() if optimizer is not None and config.checkpoint.save_optim else None,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "rng": rng_state(),
        }
        _write_atomically(os.path.join(path, "model_optim_rng.pt"), lambda f: torch.save(state, f))
    comm.barrier()
    if ps.rank == 0:
        _write_atomically(os.path.join(root, TRACKER_FILE), lambda f: f.write(f"{iteration}\n".encode()))
    comm.barrier()
    return path


def latest_iteration(root: str) -> int | None:
    tracker = os.path.join(root, TRACKER_FILE)
    if not os.path.exists(tracker):
        return None
    with open(tracker) as f:
        text = f.read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{tracker} holds {text!r}, not an iteration number; fix or delete it")
    return int(text)


def check_compatible(saved: dict, config: Config, path: str) -> None:
    """Refuse a checkpoint whose model shape or parallel layout differs from this run's flags."""
    saved_model, saved_parallel = saved["config"]["model"], saved["config"]["parallel"]
    for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                 "max_position_embeddings", "untie_embeddings_and_output_weights"):
        if saved_model.get(name) != getattr(config.model, name):
            flag = "--" + name.replace("_", "-")
            raise CheckpointError(
                f"checkpoint {path} has {flag} {saved_model.get(name)} but this run has "
                f"{getattr(config.model, name)}; pass the checkpoint's value"
            )
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        if saved_parallel.get(name) != getattr(config.parallel, name):
            flag = "--" + name.replace("_", "-")
            raise CheckpointError(
                f"checkpoint {path} was saved with {flag} {saved_parallel.get(name)}, this run uses "
                f"{getattr(config.parallel, name)}; reshard it with tools/checkpoint_reshard.py"
            )


def load_checkpoint(root: str, config: Config, ps: ParallelState, model: list[nn.Module],
                    optimizer: torch.optim.Optimizer | None, scheduler: Any) -> tuple[int, int]:
    """Load the latest checkpoint under ``root``; returns (iteration, consumed samples)."""
    iteration = latest_iteration(root)
    if iteration is None:
        raise CheckpointError(f"--load {root} holds no {TRACKER_FILE}; is it a checkpoint directory?")
    path = os.path.join(checkpoint_dir(root, iteration, ps), "model_optim_rng.pt")
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint file {path} is missing (wrong --tensor/--pipeline-model-parallel-size?)")
    state = torch.load(path, map_location=ps.device, weights_only=True)
    check_compatible(state, config, path)
    for chunk, chunk_state in zip(model, state["model"]):
        chunk.load_state_dict(chunk_state)
    if config.checkpoint.finetune:
        return 0, 0
    if optimizer is not None and config.checkpoint.load_optim and state["optimizer"] is not None:
        optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
    if config.checkpoint.load_rng:
        set_rng_state(state["rng"])
    return state["iteration"], state["consumed_samples"]
