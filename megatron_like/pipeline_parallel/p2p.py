"""Point-to-point communication between adjacent pipeline stages.

Every tensor that crosses a stage boundary has one shape known from the configuration, so no shape is
ever exchanged (Megatron's fixed-sequence-length path)::

    hidden states and their gradients: [s, b, h]   ([s / tp, b, h] with --sequence-parallel)

Each tensor-parallel rank talks to the rank with the same (tp, dp) coordinates on the neighbouring
stage. Stages form a ring: with virtual stages the last stage feeds chunk ``c + 1`` of the first stage.

Two message streams, told apart by their tag, flow between neighbours:

* ``FORWARD_TAG``: activations to the next stage (``pp_neighbor(+1)``),
* ``BACKWARD_TAG``: activation gradients to the previous stage (``pp_neighbor(-1)``).

Each stream is FIFO, and every schedule here produces and consumes a stream in the same micro-batch
order, so a message needs no header.

Sends are asynchronous: a stage never waits for its neighbour to *accept* data, only for data it needs.
:meth:`PipelineP2P.post` posts a step's sends as one ``batch_isend_irecv`` and the receives of a later
step as another, and returns a :class:`PendingRecv` to wait on when that step starts; sends (and their
tensors) are kept until they complete. Posting receives early matters: gloo (like NCCL) moves the data
only once the receiver has posted its receive, so a receive posted just before it is needed costs a
round trip between the processes on every step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_like import collectives as comm
from megatron_like.parallel_state import ParallelState

FORWARD_TAG = 0
BACKWARD_TAG = 1


def pipeline_tensor_shape(seq_length: int, micro_batch_size: int, hidden_size: int, tp_size: int = 1,
                          sequence_parallel: bool = False) -> tuple[int, int, int]:
    """Shape of the hidden states sent between stages: ``(s, b, h)``, or ``(s / tp, b, h)`` with SP."""
    if sequence_parallel:
        if seq_length % tp_size != 0:
            raise ValueError(f"--seq-length {seq_length} is not divisible by --tensor-model-parallel-size {tp_size}")
        seq_length //= tp_size
    return (seq_length, micro_batch_size, hidden_size)


class PendingRecv:
    """Receives posted by :meth:`PipelineP2P.post`; :meth:`wait` returns ``(from_prev, from_next)``."""

    def __init__(self, works: list[dist.Work], from_prev: torch.Tensor | None,
                 from_next: torch.Tensor | None) -> None:
        self.works, self.tensors = works, (from_prev, from_next)

    def wait(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        for work in self.works:
            work.wait()
        return self.tensors


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

    def post(
        self,
        send_next: torch.Tensor | None = None,
        send_prev: torch.Tensor | None = None,
        recv_prev: bool = False,
        recv_next: bool = False,
    ) -> PendingRecv:
        """Start sending activations forward / gradients backward and start receiving.

        Args:
            send_next: hidden states ``[s, b, h]`` for the next stage, or None.
            send_prev: the gradient ``[s, b, h]`` of this stage's input for the previous stage, or None.
            recv_prev: receive hidden states ``[s, b, h]`` from the previous stage.
            recv_next: receive the gradient ``[s, b, h]`` of this stage's output from the next stage.
        Returns:
            the posted receives. Sends and receives go in separate batches, so that waiting for a
            receive never waits for a send (a coalescing backend returns one work per batch).
        """
        sends = [
            (self._checked(tensor.detach()), peer, tag)
            for tensor, peer, tag in ((send_next, self.next_rank, FORWARD_TAG),
                                      (send_prev, self.prev_rank, BACKWARD_TAG))
            if tensor is not None
        ]
        if sends:
            self._pending_sends = [(w, t) for w, t in self._pending_sends if not all(x.is_completed() for x in w)]
            self._pending_sends.append((comm.post_p2p(sends, []), [tensor for tensor, _, _ in sends]))
        from_prev = self._empty() if recv_prev else None
        from_next = self._empty() if recv_next else None
        recvs = [
            (buffer, peer, tag)
            for buffer, peer, tag in ((from_prev, self.prev_rank, FORWARD_TAG),
                                      (from_next, self.next_rank, BACKWARD_TAG))
            if buffer is not None
        ]
        return PendingRecv(comm.post_p2p([], recvs), from_prev, from_next)

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
