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

Sends and receives are asynchronous. :meth:`PipelineP2P.post` issues one ``batch_isend_irecv`` of up
to four operations (send forward, send backward, receive from the previous stage, receive from the next)
and returns a :class:`Received` per receive, to wait on when the step that needs it starts. Which
operations go into one batch, and when, is the schedule's communication plan (``schedules.py``): NCCL
runs the batches of a rank one after the other on one stream, and a batch finishes only when its peers
have posted the matching operations, so the grouping decides whether a pipeline can deadlock.
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

    def post(
        self,
        send_next: torch.Tensor | None = None,
        send_prev: torch.Tensor | None = None,
        recv_prev: bool = False,
        recv_next: bool = False,
    ) -> tuple[Received | None, Received | None]:
        """Start sending activations forward / gradients backward and start receiving, as one batch.

        Args:
            send_next: hidden states ``[s, b, h]`` for the next stage, or None.
            send_prev: the gradient ``[s, b, h]`` of this stage's input for the previous stage, or None.
            recv_prev: receive hidden states ``[s, b, h]`` from the previous stage.
            recv_next: receive the gradient ``[s, b, h]`` of this stage's output from the next stage.
        Returns:
            ``(from_prev, from_next)``, the posted receives (None where not asked for). A backend that
            returns one work per operation (gloo) lets each receive be waited for alone; a coalescing one
            (NCCL) returns one work for the batch, which every receive of the batch then waits for.
        """
        sends = [
            (self._checked(tensor.detach()), peer, tag)
            for tensor, peer, tag in ((send_next, self.next_rank, FORWARD_TAG),
                                      (send_prev, self.prev_rank, BACKWARD_TAG))
            if tensor is not None
        ]
        from_prev = self._empty() if recv_prev else None
        from_next = self._empty() if recv_next else None
        recvs = [
            (buffer, peer, tag)
            for buffer, peer, tag in ((from_prev, self.prev_rank, FORWARD_TAG),
                                      (from_next, self.next_rank, BACKWARD_TAG))
            if buffer is not None
        ]
        if not sends and not recvs:
            return None, None
        works = comm.post_p2p(sends, recvs)
        per_operation = len(works) == len(sends) + len(recvs)
        send_works, recv_works = (works[:len(sends)], works[len(sends):]) if per_operation else (works, works)
        if sends:
            self._pending_sends = [(w, t) for w, t in self._pending_sends if not all(x.is_completed() for x in w)]
            self._pending_sends.append((send_works, [tensor for tensor, _, _ in sends]))
        handles = [Received(buffer, [recv_works[n]] if per_operation else recv_works)
                   for n, (buffer, _, _) in enumerate(recvs)]
        return (handles.pop(0) if recv_prev else None), (handles.pop(0) if recv_next else None)

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
