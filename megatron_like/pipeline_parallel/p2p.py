"""Point-to-point communication between adjacent pipeline stages.

Every tensor that crosses a stage boundary has one shape known from the configuration, so no shape is
ever exchanged (Megatron's fixed-sequence-length path)::

    hidden states and their gradients: [s, b, h]   ([s / tp, b, h] with --sequence-parallel)

Each tensor-parallel rank talks to the rank with the same (tp, dp) coordinates on the neighbouring
stage. Stages form a ring: with virtual stages the last stage feeds chunk ``c + 1`` of the first stage.

Two message streams, told apart by their tag, flow between neighbours: ``ACTIVATION_TAG`` (a forward's
output for the next stage) and ``GRADIENT_TAG`` (a backward's input gradient for the previous stage). Which
rank holds the next stage is the chunk placement's (``placement.py``): ``pp_neighbor(+1)`` for activations
on the ring; on the V, chunk 1's activations go to ``pp_neighbor(-1)``.

Each stream is FIFO, and every schedule here produces and consumes a stream in the same micro-batch
order, so a message needs no header.

Sends and receives are asynchronous. :meth:`PipelineP2P.post` issues one ``batch_isend_irecv`` of the
sends and receives of one slot of the schedule and returns a :class:`Received` per receive, to wait on
when the step that needs it starts. Which
operations go into one batch, and when, is the schedule's communication plan (``schedules.py``): NCCL
runs the batches of a rank one after the other on one stream, and a batch finishes only when its peers
have posted the matching operations, so the grouping decides whether a pipeline can deadlock.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron_like import collectives as comm
from megatron_like.parallel_state import ParallelState
from megatron_like.pipeline_parallel.placement import ACTIVATION_TAG, GRADIENT_TAG

__all__ = ["ACTIVATION_TAG", "GRADIENT_TAG", "PipelineP2P", "Received", "pipeline_tensor_shape"]


def pipeline_tensor_shape(seq_length: int, micro_batch_size: int, hidden_size: int, tp_size: int = 1,
                          sequence_parallel: bool = False) -> tuple[int, int, int]:
    """Shape of the hidden states sent between stages: ``(s, b, h)``, or ``(s / tp, b, h)`` with SP."""
    if sequence_parallel:
        if seq_length % tp_size != 0:
            raise ValueError(f"--seq-length {seq_length} is not divisible by --tensor-model-parallel-size {tp_size}")
        seq_length //= tp_size
    return (seq_length, micro_batch_size, hidden_size)


class Received:
    """A posted receive: :meth:`wait` returns the tensor once it has arrived."""

    def __init__(self, tensor: torch.Tensor, works: list[dist.Work]) -> None:
        self.tensor, self.works = tensor, works

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        self.works = []
        return self.tensor


class PipelineP2P:
    """Sends and receives of one pipeline rank for one schedule run (a global batch).

    Args:
        ps: the parallel state; neighbours are ``ps.pp_neighbor(-1)`` and ``ps.pp_neighbor(+1)``.
        tensor_shape: ``[s, b, h]`` (or ``[s / tp, b, h]``), see :func:`pipeline_tensor_shape`.
        dtype: the dtype of the hidden states (the model's parameter dtype).
    """

    def __init__(self, ps: ParallelState, tensor_shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.prev_rank, self.next_rank = ps.pp_neighbor(-1), ps.pp_neighbor(+1)
        self.tensor_shape, self.dtype, self.device = tuple(tensor_shape), dtype, ps.device
        self._pending_sends: list[tuple[list[dist.Work], list[torch.Tensor]]] = []
        """Works of posted sends with the tensors they read (kept alive until the sends complete)."""

    def post(self, sends: Sequence[tuple[torch.Tensor, int, int]] = (),
             receives: Sequence[tuple[int, int]] = ()) -> list[Received]:
        """Start sending and receiving, as one batch.

        Args:
            sends: ``(tensor, peer, tag)``: hidden states or their gradient ``[s, b, h]`` for the rank
                ``peer`` (+1 the next pipeline rank, -1 the previous) on stream ``tag`` (ACTIVATION_TAG or
                GRADIENT_TAG).
            receives: ``(peer, tag)``: a ``[s, b, h]`` tensor to receive from that rank on that stream.
        Returns:
            One posted :class:`Received` per entry of ``receives``, in order. A backend that returns one
            work per operation (gloo) lets each receive be waited for alone; a coalescing one (NCCL) returns
            one work for the batch, which every receive of the batch then waits for.
        """
        outgoing = [(self._checked(tensor.detach()), self._peer_rank(peer), tag) for tensor, peer, tag in sends]
        incoming = [(self._empty(), self._peer_rank(peer), tag) for peer, tag in receives]
        if not outgoing and not incoming:
            return []
        works = comm.post_p2p(outgoing, incoming)
        per_operation = len(works) == len(outgoing) + len(incoming)
        send_works, recv_works = (works[:len(outgoing)], works[len(outgoing):]) if per_operation else (works, works)
        if outgoing:
            self._pending_sends = [(w, t) for w, t in self._pending_sends if not all(x.is_completed() for x in w)]
            self._pending_sends.append((send_works, [tensor for tensor, _, _ in outgoing]))
        return [Received(buffer, [recv_works[n]] if per_operation else recv_works)
                for n, (buffer, _, _) in enumerate(incoming)]

    def _peer_rank(self, peer: int) -> int:
        if peer not in (1, -1):
            raise ValueError(f"a pipeline message goes to the next (+1) or previous (-1) rank, not {peer}")
        return self.next_rank if peer == 1 else self.prev_rank

    def wait_for_sends(self) -> None:
        """Block until every send posted so far has completed (call at the end of a schedule)."""
        for works, _ in self._pending_sends:
            for work in works:
                work.wait()
        self._pending_sends = []

    def _empty(self) -> torch.Tensor:
        return torch.empty(self.tensor_shape, dtype=self.dtype, device=self.device)

    def _checked(self, tensor: torch.Tensor) -> torch.Tensor:
        if tuple(tensor.shape) != self.tensor_shape or tensor.dtype != self.dtype:
            raise ValueError(
                f"a pipeline stage produced a {tuple(tensor.shape)} {tensor.dtype} tensor but the configured "
                f"pipeline tensor is {self.tensor_shape} {self.dtype} ([seq/tp if sequence parallel else seq, "
                "micro batch, hidden] from --seq-length, --micro-batch-size, --hidden-size)"
            )
        return tensor.contiguous()
