"""Every collective the codebase calls, in one small module.

A backend gap or a torch rename is mended here once. Each function takes the process group to use;
a ``None`` group means a group of one process, and the call is a no-op (or returns its input).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

Group = Optional[dist.ProcessGroup]  # noqa: UP045 - a runtime alias, not an annotation

# torch 2.13 renamed the flat-tensor collectives; older releases only have the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def is_initialized() -> bool:
    """Whether a process group is up (False in a plain single-process run)."""
    return dist.is_initialized()


def new_world_group() -> Group:
    """A second group over every rank (collective: all ranks call it), for work on another thread, such as an
    asynchronous checkpoint write, whose collectives must not interleave with training's; None alone."""
    return dist.new_group(backend="gloo") if dist.is_initialized() else None


# ---------------------------------------------------------------- traffic counting
# Benchmarks and tests measure how many bytes a step communicates (``benchmarks/parallel_overhead.py``).


def ring_bytes_sent(kind: str, nbytes: int, world: int) -> int:
    """Bytes one rank sends for a collective under the ring algorithms (bandwidth-optimal, as NCCL and gloo).

    ``nbytes`` is the full (unsharded) tensor: the all-reduce's buffer, the all-gather's output, the
    reduce-scatter's input. all-reduce sends ``2 (w - 1) / w`` of it, all-gather and reduce-scatter
    ``(w - 1) / w``, broadcast ``(w - 1) / w`` (a scatter + all-gather pipeline), a point-to-point send all of it.
    """
    if world <= 1:
        return 0
    if kind == "all_reduce":
        return 2 * nbytes * (world - 1) // world
    if kind in ("all_gather", "reduce_scatter", "broadcast"):
        return nbytes * (world - 1) // world
    if kind == "send":
        return nbytes
    raise ValueError(f"unknown collective kind {kind!r}")


@dataclass
class Traffic:
    """Bytes this rank sent inside a :func:`count_traffic` block, in total and per collective kind."""

    bytes_sent: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, nbytes: int, world: int) -> None:
        sent = ring_bytes_sent(kind, nbytes, world)
        self.bytes_sent += sent
        self.by_kind[kind] = self.by_kind.get(kind, 0) + sent


_traffic: Traffic | None = None


@contextmanager
def count_traffic() -> Iterator[Traffic]:
    """Count the bytes every collective of this module sends from this rank while the block runs."""
    global _traffic
    outer, _traffic = _traffic, Traffic()
    try:
        yield _traffic
    finally:
        _traffic = outer


def record_traffic(kind: str, nbytes: int, world: int) -> None:
    """Add one collective over ``world`` ranks on a ``nbytes`` tensor to the open :func:`count_traffic` block."""
    if _traffic is not None:
        _traffic.add(kind, nbytes, world)


def _record(kind: str, tensor: torch.Tensor, group: Group) -> None:
    if _traffic is not None:
        _traffic.add(kind, tensor.numel() * tensor.element_size(), group_size(group))


def group_size(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Group) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_reduce(tensor: torch.Tensor, group: Group, op: str = "sum") -> torch.Tensor:
    """Reduce ``tensor`` in place over ``group`` (op: sum, max, min, avg) and return it."""
    if group is None:
        return tensor
    _record("all_reduce", tensor, group)
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    if op == "avg":
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        return tensor.div_(group_size(group))
    dist.all_reduce(tensor, op=ops[op], group=group)
    return tensor


def all_gather_along_dim(tensor: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim``: [.., n, ..] -> [.., world * n, ..]."""
    world = group_size(group)
    if world == 1:
        return tensor
    tensor = tensor.movedim(dim, 0).contiguous()
    gathered = torch.empty((world * tensor.shape[0],) + tensor.shape[1:], dtype=tensor.dtype, device=tensor.device)
    _record("all_gather", gathered, group)
    _all_gather_flat(gathered, tensor, group=group)
    return gathered.movedim(0, dim)


def reduce_scatter_along_dim(tensor: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """Sum over ranks, then keep this rank's chunk along ``dim``: [.., world * n, ..] -> [.., n, ..]."""
    world = group_size(group)
    if world == 1:
        return tensor
    tensor = tensor.movedim(dim, 0).contiguous()
    if tensor.shape[0] % world != 0:
        raise ValueError(f"dimension {dim} of size {tensor.shape[0]} does not split over {world} ranks")
    out = torch.empty((tensor.shape[0] // world,) + tensor.shape[1:], dtype=tensor.dtype, device=tensor.device)
    _record("reduce_scatter", tensor, group)
    _reduce_scatter_flat(out, tensor, group=group)
    return out.movedim(0, dim)


def split_along_dim(tensor: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """This rank's contiguous chunk of ``tensor`` along ``dim`` (no communication)."""
    world = group_size(group)
    if world == 1:
        return tensor
    if tensor.shape[dim] % world != 0:
        raise ValueError(f"dimension {dim} of size {tensor.shape[dim]} does not split over {world} ranks")
    return tensor.chunk(world, dim=dim)[group_rank(group)].contiguous()


def broadcast(tensor: torch.Tensor, src_global_rank: int, group: Group) -> torch.Tensor:
    """Copy ``tensor`` from ``src_global_rank`` to every rank of ``group`` (in place)."""
    if group is not None:
        _record("broadcast", tensor, group)
        dist.broadcast(tensor, src=src_global_rank, group=group)
    return tensor


def all_to_all(tensor: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int],
               group: Group) -> torch.Tensor:
    """All-to-all along dim 0 with uneven splits (expert parallelism's token exchange).

    ``tensor [sum(input_split_sizes), ...]``: rows ``input_split_sizes[j]`` go to rank j of ``group``;
    returns ``[sum(output_split_sizes), ...]``, the rows from rank 0, then rank 1, ... (``output_split_sizes[j]``
    from rank j). A group of one returns ``tensor``.
    """
    if group is None:
        return tensor
    tensor = tensor.contiguous()
    out = torch.empty((sum(output_split_sizes),) + tuple(tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    if _traffic is not None:  # what this rank sends to the others (its own rows stay)
        row = tensor[0].numel() * tensor.element_size() if tensor.shape[0] else 0
        _traffic.add("send", (tensor.shape[0] - input_split_sizes[group_rank(group)]) * row, 2)
    dist.all_to_all_single(out, tensor, output_split_sizes, input_split_sizes, group=group)
    return out


def world_group() -> Group:
    """Every process of the job, or None when no process group was started (one process)."""
    return dist.group.WORLD if dist.is_initialized() else None


def first_error(message: str | None, group: Group, device: torch.device | str = "cpu") -> str | None:
    """Agree on failure: every rank of ``group`` passes its error (None = fine) and gets the same answer.

    Returns None when no rank failed, else the message of the lowest failing rank. Two collectives (an
    all-reduce of the failing ranks, then a broadcast of one message), so the ranks stay in lockstep
    whatever failed where.
    """
    if group is None:
        return message
    world, rank = group_size(group), dist.get_rank()
    failing = torch.tensor([rank if message is not None else dist.get_world_size()], dtype=torch.long,
                           device=device)  # global ranks; NCCL needs device tensors
    dist.all_reduce(failing, op=dist.ReduceOp.MIN, group=group)
    src = int(failing)
    if src >= dist.get_world_size():
        return None
    payload = (message or "").encode()[: 1 << 16] if rank == src else b""
    size = torch.tensor([len(payload)], dtype=torch.long, device=device)
    dist.broadcast(size, src=src, group=group)
    data = (torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device) if payload
            else torch.empty(int(size), dtype=torch.uint8, device=device))
    if world > 1 and int(size) > 0:
        dist.broadcast(data, src=src, group=group)
    return data.cpu().numpy().tobytes().decode(errors="replace")


def shutdown() -> None:
    """Leave the process group cleanly at the end of a run: wait for every rank, then free the backend.

    Exiting with a live gloo group lets its threads be torn down by the interpreter's exit, which can
    abort a process ("terminate called without an active exception") after all its work was done.
    """
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def barrier(group: Group = None) -> None:
    """Wait for every rank of ``group`` (the whole world when None and distributed)."""
    if dist.is_initialized():
        dist.barrier(group=group)


def post_p2p(sends: list[tuple[torch.Tensor, int, int]], recvs: list[tuple[torch.Tensor, int, int]]) -> list:
    """Start the sends and receives ``(tensor, peer global rank, tag)`` as one batch; return their works.

    ``.wait()`` a work before reading a received tensor or writing a sent one.
    """
    if _traffic is not None:
        for t, _, _ in sends:
            _traffic.add("send", t.numel() * t.element_size(), 2)
    ops = [dist.P2POp(dist.isend, t, peer, tag=tag) for t, peer, tag in sends]
    ops += [dist.P2POp(dist.irecv, t, peer, tag=tag) for t, peer, tag in recvs]
    return dist.batch_isend_irecv(ops) if ops else []


def exchange(
    sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]
) -> None:
    """Post all sends and receives (tensor, peer global rank) together and wait for them.

    Batching them lets adjacent pipeline stages exchange in both directions without ordering deadlocks.
    """
    for work in post_p2p([(t, peer, 0) for t, peer in sends], [(t, peer, 0) for t, peer in recvs]):
        work.wait()


# ---------------------------------------------------------------- flat-buffer collectives of data parallelism
# They take and return whole flat buffers and can run asynchronously: ``async_op=True`` returns the work
# handle (``.wait()`` it before reading the output) so a gradient bucket's reduction overlaps backward.


def all_reduce_flat(tensor: torch.Tensor, group: Group, async_op: bool = False) -> dist.Work | None:
    """Sum ``tensor`` in place over ``group``; the work handle when ``async_op`` (None for a group of one)."""
    if group is None:
        return None
    _record("all_reduce", tensor, group)
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


# gloo has no reduce-scatter and no in-place all-gather of its own. torch's gloo ``reduce_scatter_tensor``
# clones the whole input, all-reduces the clone (twice the bytes of a reduce-scatter) and copies this rank's
# chunk out; its ``all_gather_into_tensor`` gathers into a temporary as large as the output and copies that
# over. For the ZeRO buffers (the gradient reduce-scatter and the parameter all-gather of every step) the
# flat collectives below use gloo primitives that move exactly the bytes of the collective they stand for,
# without those full-size copies: measured per rank on 2 processes, 90 MB fp32, CPU seconds, torch's -> ours
# (benchmarks/gloo_collectives.py, docs/performance.md): reduce-scatter 0.133 -> 0.053, all-gather 0.106 -> 0.026.


class _Finishing:
    """A work handle over several in-flight works; ``wait`` waits for them all, then runs ``then`` on the caller's
    thread (so a temporary it frees is freed where the profiler's memory log looks)."""

    def __init__(self, works: list[dist.Work], then: Callable[[], None] | None = None) -> None:
        self.works, self.then = works, then

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        self.works = []
        if self.then is not None:
            then, self.then = self.then, None
            then()
        return True


def _is_gloo(group: Group) -> bool:
    return dist.get_backend(group) == "gloo"


def _finish(work: _Finishing, async_op: bool) -> _Finishing | None:
    if async_op:
        return work
    work.wait()
    return None


def _is_own_chunk(output: torch.Tensor, own: torch.Tensor) -> bool:
    """Whether ``output`` is ``own`` itself (same memory, same length): the collective then works in place."""
    return output.data_ptr() == own.data_ptr() and output.numel() == own.numel()


# The tag of the reduce-scatter's point-to-point messages, apart from the pipeline's (0 and 1, pipeline_parallel/
# p2p.py). gloo matches a receive to a send by (peer, tag) in posting order, and every rank of a group launches
# its reduce-scatters in the same order, so successive ones in flight on a group pair up correctly. gloo's
# collectives (the param all-gather's broadcasts, running at the same time) use slots of their own, never a
# point-to-point tag.
_REDUCE_SCATTER_TAG = 0x5253


def reduce_scatter_flat(output: torch.Tensor, tensor: torch.Tensor, group: Group,
                        async_op: bool = False) -> dist.Work | None:
    """Sum ``tensor [world * n]`` over ``group`` and write this rank's chunk into ``output [n]``.

    ``output`` may be this rank's chunk of ``tensor`` (an in-place reduce-scatter, as NCCL allows): the other
    ranks' chunks are then added into it, nothing is copied. On gloo: one batch of point-to-point messages sends
    chunk ``j`` of ``tensor`` to rank ``j`` for every other rank ((w - 1) / w of the bytes, as a ring
    reduce-scatter) and receives the other ranks' chunks of this rank's part into a buffer ``[w - 1, n]``; when
    waited for (on the caller's thread, which also frees that buffer) this rank's own chunk and the received
    ones are summed into ``output``.
    """
    if group is None:
        if output.data_ptr() != tensor.data_ptr():
            output.copy_(tensor)
        return None
    _record("reduce_scatter", tensor, group)
    if not _is_gloo(group):
        return _reduce_scatter_flat(output, tensor, group=group, async_op=async_op)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if tensor.numel() != world * output.numel():
        raise ValueError(f"reduce_scatter_flat: input of {tensor.numel()} elements is not {world} x the "
                         f"output's {output.numel()}")
    chunks = tensor.view(world, -1)
    peers = [r for r in range(world) if r != rank]
    received = torch.empty((world - 1, output.numel()), dtype=tensor.dtype, device=tensor.device)
    ops = [dist.P2POp(dist.isend, chunks[r], group=group, group_peer=r, tag=_REDUCE_SCATTER_TAG) for r in peers]
    ops += [dist.P2POp(dist.irecv, received[i], group=group, group_peer=r, tag=_REDUCE_SCATTER_TAG)
            for i, r in enumerate(peers)]

    def then() -> None:
        own = chunks[rank]
        if _is_own_chunk(output, own):
            output.add_(received[0])
        else:
            torch.add(own, received[0], out=output)
        for row in received[1:]:
            output.add_(row)
        received.untyped_storage().resize_(0)

    return _finish(_Finishing(dist.batch_isend_irecv(ops), then), async_op)


def all_gather_flat(output: torch.Tensor, tensor: torch.Tensor, group: Group,
                    async_op: bool = False) -> dist.Work | None:
    """Concatenate every rank's ``tensor [n]`` into ``output [world * n]`` (rank order). ``tensor`` may be this
    rank's chunk of ``output`` (an in-place gather, as NCCL allows).

    On gloo: each rank's chunk of ``output`` is broadcast from that rank in place (its ``tensor`` is first
    copied there unless it already is that chunk), so no temporary of the output's size is made.
    """
    if group is None:
        output.copy_(tensor)
        return None
    _record("all_gather", output, group)
    if not _is_gloo(group):
        return _all_gather_flat(output, tensor, group=group, async_op=async_op)
    chunks = output.chunk(dist.get_world_size(group))
    own = chunks[dist.get_rank(group)]
    if own.data_ptr() != tensor.data_ptr():
        own.copy_(tensor)
    works = [dist.broadcast(chunk, src=dist.get_global_rank(group, r), group=group, async_op=True)
             for r, chunk in enumerate(chunks)]
    return _finish(_Finishing(works), async_op)
