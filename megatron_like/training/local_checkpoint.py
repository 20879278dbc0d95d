"""Fast recovery: ``--local-checkpoint-interval N`` keeps every rank's state in host memory and on a peer.

Every ``N`` iterations each rank serializes its own state (its model chunks' state dicts, its optimizer shard, the
lr schedule, its generators, the iteration and the consumed samples: what a torch-format checkpoint holds for it)
and

* writes it to ``/dev/shm`` (a file system in RAM) as its *own* copy, and
* sends it to its peer, which writes it to its ``/dev/shm`` as a *held* copy: the peer is the rank of the same
  (tp, pp, cp) position at the next data-parallel rank (its replica), or the next global rank when dp = 1.

Why files in ``/dev/shm`` and not the worker's memory: torchrun's restart kills every worker, so a copy must live
outside the worker process; ``/dev/shm`` outlives it (it is freed at reboot or by deleting the files), needs no agent
process to manage, and each file is written under a temporary name and renamed (never half-written). On several
nodes the peer is usually on another node (the data-parallel replica), so the state of a lost node is still held
elsewhere. The files live in ``/dev/shm/megatron_like-local-<hash of --save>-<hash of the model and parallel
flags>-<torchrun run id>/``; a new job on the same ``--save`` deletes the directories of earlier jobs, and a run that
ends normally deletes its own.

After a restart (:func:`restore_local_checkpoint`, before the persistent checkpoint is read) every rank announces the
copies in its slot of the directory (its own and the one it holds); all ranks gather the announcements and pick the
newest iteration for which *every* rank's state survives somewhere. If that is newer than the checkpoint the tracker
of ``--load`` names, each rank reads its own copy, or receives the held copy from the rank that announced it; else
the run loads the persistent checkpoint as usual. The restored state is exactly the one a straight run had at that
iteration, so the run goes on bitwise as if nothing happened.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import io
import json
import os
import shutil
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megatron_like import collectives as comm
from megatron_like.config import Config
from megatron_like.parallel_state import ParallelState
from megatron_like.training.checkpointing import TEMPORARY_MARK, rng_state, set_rng_state

SHM_ROOT = "/dev/shm"
NO_COPY = (-1, -1, 0)
"""An empty announcement slot: (state of rank, iteration, bytes)."""


@dataclass(frozen=True)
class Copy:
    """One local copy in this process's slot: whose state, of which iteration, and its file."""

    rank: int
    iteration: int
    path: str

    @property
    def announcement(self) -> tuple[int, int, int]:
        return self.rank, self.iteration, os.path.getsize(self.path)


def _run_id() -> str:
    return "".join(c for c in os.environ.get("TORCHELASTIC_RUN_ID", "none") if c.isalnum() or c in "-_")[:64]


def _save_key(save: str) -> str:
    return hashlib.sha256(os.path.abspath(save).encode()).hexdigest()[:16]


def _layout_key(config: Config) -> str:
    """A hash of the model and parallel flags: copies of another model or layout are never offered to this run."""
    saved = config.to_dict()
    return hashlib.sha256(json.dumps([saved["model"], saved["parallel"]], sort_keys=True).encode()).hexdigest()[:8]


def local_directory(config: Config, run_id: str | None = None) -> str:
    """``/dev/shm/megatron_like-local-<hash of --save>-<hash of model and layout>-<run id>``: where this job's local
    copies live."""
    return os.path.join(SHM_ROOT, f"megatron_like-local-{_save_key(config.checkpoint.save)}-{_layout_key(config)}-"
                                  f"{run_id or _run_id()}")


def _slot() -> int:
    """This process's slot: its global rank (also on several nodes of one host, each file has one announcer). A
    restart that gives the rank to another node finds no copy there, and the run falls back to the persistent
    checkpoint."""
    return int(os.environ.get("RANK", "0"))


def peer_ranks(ps: ParallelState) -> tuple[int, int]:
    """(the rank this rank sends its copy to, the rank whose copy it holds): the data-parallel replica ring, or the
    ring over all ranks when dp = 1."""
    if ps.dp_size > 1:
        return (ps.rank_of(ps.tp_rank, (ps.dp_rank + 1) % ps.dp_size, ps.pp_rank, ps.cp_rank),
                ps.rank_of(ps.tp_rank, (ps.dp_rank - 1) % ps.dp_size, ps.pp_rank, ps.cp_rank))
    return (ps.rank + 1) % ps.world_size, (ps.rank - 1) % ps.world_size


def _copies(directory: str, kind: str) -> list[Copy]:
    """This slot's copies of ``kind`` ("own" or "held"), newest first."""
    found = []
    for path in glob.glob(os.path.join(directory, f"slot{_slot()}-{kind}-rank*-iter*.pt")):
        rank, iteration = os.path.basename(path)[:-3].split("-rank")[1].split("-iter")
        found.append(Copy(int(rank), int(iteration), path))
    return sorted(found, key=lambda c: -c.iteration)


def _write(directory: str, kind: str, rank: int, iteration: int, payload: memoryview) -> None:
    """Write one copy atomically, then delete this slot's older copies of that kind."""
    path = os.path.join(directory, f"slot{_slot()}-{kind}-rank{rank}-iter{iteration}.pt")
    tmp = f"{path}{TEMPORARY_MARK}{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(payload)
    os.replace(tmp, path)
    for old in _copies(directory, kind):
        if old.path != path:
            os.remove(old.path)


def _state(iteration: int, consumed: int, model: list[nn.Module], optimizer: Any, scheduler: Any) -> bytes:
    state = {"iteration": iteration, "consumed_samples": consumed, "model": [chunk.state_dict() for chunk in model],
             "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "rng": rng_state()}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def _bytes_tensor(payload: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8)


class LocalCheckpoints:
    """The local copies of one run: :meth:`save` every ``--local-checkpoint-interval`` iterations."""

    def __init__(self, config: Config, ps: ParallelState) -> None:
        self.interval = config.checkpoint.local_checkpoint_interval
        self.directory = local_directory(config)
        self.ps = ps
        os.makedirs(self.directory, exist_ok=True)

    def due(self, iteration: int) -> bool:
        return self.interval is not None and iteration % self.interval == 0

    def save(self, iteration: int, consumed: int, model: list[nn.Module], optimizer: Any, scheduler: Any) -> None:
        """Write this rank's copy and the peer's (all ranks together)."""
        payload = _state(iteration, consumed, model, optimizer, scheduler)
        _write(self.directory, "own", self.ps.rank, iteration, memoryview(payload))
        if self.ps.world_size == 1:
            return
        send_to, held_for = peer_ranks(self.ps)
        device = self.ps.device  # NCCL moves device tensors only
        sizes = (torch.tensor([len(payload)], dtype=torch.long, device=device), torch.zeros(1, dtype=torch.long,
                                                                                          device=device))
        comm.exchange([(sizes[0], send_to)], [(sizes[1], held_for)])
        received = torch.empty(int(sizes[1]), dtype=torch.uint8, device=device)
        comm.exchange([(_bytes_tensor(payload).to(device), send_to)], [(received, held_for)])
        _write(self.directory, "held", held_for, iteration, memoryview(received.cpu().numpy()))

    def close(self) -> None:
        """The run ended normally: free the memory of this slot's copies (the directory goes with the last one)."""
        for kind in ("own", "held"):
            for copy in _copies(self.directory, kind):
                os.remove(copy.path)
        with contextlib.suppress(OSError):  # other slots' copies are still there
            os.rmdir(self.directory)


def remove_earlier_jobs(config: Config) -> None:
    """Delete the local copies of earlier jobs on ``--save`` (the job lock makes this job its only user)."""
    this = local_directory(config)
    for directory in glob.glob(os.path.join(SHM_ROOT, f"megatron_like-local-{_save_key(config.checkpoint.save)}-*")):
        if directory != this:
            shutil.rmtree(directory, ignore_errors=True)


def _pick(announced: torch.Tensor, world_size: int, persistent: int | None) -> int | None:
    """The newest iteration at which every rank's state is announced by some rank, if newer than ``persistent``."""
    have: dict[int, set[int]] = {}
    for rank, iteration, _ in announced.view(-1, 3).tolist():
        if rank >= 0:
            have.setdefault(iteration, set()).add(rank)
    complete = [iteration for iteration, ranks in have.items() if len(ranks) == world_size]
    best = max(complete, default=None)
    return best if best is not None and (persistent is None or best > persistent) else None


def restore_local_checkpoint(config: Config, ps: ParallelState, model: list[nn.Module], optimizer: Any,
                             scheduler: Any, persistent: int | None) -> tuple[int, int] | None:
    """Restore every rank from the local copies when all of them survive at an iteration newer than the persistent
    checkpoint's ``persistent``; returns (iteration, consumed samples), or None (load the persistent one). All ranks
    call it together; every rank gets the same answer."""
    directory = local_directory(config)
    if os.environ.get("LOCAL_RANK", "0") == "0":  # one process per node
        remove_earlier_jobs(config)
    comm.barrier()
    mine = [copy for kind in ("own", "held") for copy in _copies(directory, kind)[:1]]
    slots = [copy.announcement for copy in mine] + [NO_COPY] * (2 - len(mine))
    announced = torch.tensor(slots, dtype=torch.long, device=ps.device).view(1, 6)
    if ps.world_size > 1:
        announced = comm.all_gather_along_dim(announced, comm.world_group(), dim=0)
    announced = announced.cpu()
    iteration = _pick(announced, ps.world_size, persistent)
    if iteration is None:
        return None
    table = announced.view(ps.world_size, 2, 3)
    payload = _gather_own_state(ps, table, iteration, {(c.rank, c.iteration): c.path for c in mine})
    state = torch.load(io.BytesIO(payload), weights_only=True)
    for chunk, chunk_state in zip(model, state["model"]):
        chunk.load_state_dict(chunk_state)
    optimizer.load_state_dict(state["optimizer"])
    if not optimizer.master_loaded:
        optimizer.reload_model_params()
    scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    return state["iteration"], state["consumed_samples"]


def _gather_own_state(ps: ParallelState, table: torch.Tensor, iteration: int, paths: dict) -> bytes:
    """This rank's state at ``iteration``: its own file when it announced it, else sent by the first rank that
    announced it. Every rank sends the copies it is the first announcer of to ranks that lack their own."""
    def announcer(of_rank: int) -> tuple[int, int]:
        """(first rank announcing ``of_rank``'s state at ``iteration``, its size); the rank itself first."""
        order = [of_rank] + [r for r in range(ps.world_size) if r != of_rank]
        for holder in order:
            for rank, it, size in table[holder].tolist():
                if rank == of_rank and it == iteration:
                    return holder, size
        raise AssertionError("picked an iteration some rank's state lacks")

    sends, recvs, received = [], [], None
    for of_rank in range(ps.world_size):
        holder, size = announcer(of_rank)
        if holder == of_rank:
            continue
        if holder == ps.rank:
            with open(paths[(of_rank, iteration)], "rb") as f:
                sends.append((_bytes_tensor(f.read()).to(ps.device), of_rank))
        if of_rank == ps.rank:
            received = torch.empty(size, dtype=torch.uint8, device=ps.device)
            recvs.append((received, holder))
    if sends or recvs:
        comm.exchange(sends, recvs)
    if received is not None:
        return received.cpu().numpy().tobytes()
    with open(paths[(ps.rank, iteration)], "rb") as f:
        return f.read()
