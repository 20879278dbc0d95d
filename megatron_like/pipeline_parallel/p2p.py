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
order, so a message needs no header. Sends are asynchronous: :meth:`PipelineP2P.communicate` posts the
sends of the step just computed together with the receives of the next step in one
``batch_isend_irecv``, waits only for the receives and keeps the sends (and their tensors) alive until
they complete. A stage therefore never waits for its neighbour to *accept* data, only for data it needs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

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
        self._pending_sends: list[tuple[dist.Work, torch.Tensor]] = []

    def communicate(
        self,
        send_next: torch.Tensor | None = None,
        send_prev: torch.Tensor | None = None,
        recv_prev: bool = False,
        recv_next: bool = False,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Send activations forward / gradients backward and receive the next step's inputs.

        Args:
            send_next: hidden states ``[s, b, h]`` for the next stage, or None.
            send_prev: the gradient ``[s, b, h]`` of this stage's input for the previous stage, or None.
            recv_prev: receive hidden states from the previous stage.
            recv_next: receive the gradient of this stage's output from the next stage.
        Returns:
            ``(from_prev, from_next)``: the received ``[s, b, h]`` tensors (None where not requested).
        """
        ops: list[dist.P2POp] = []
        for tensor, peer, tag in ((send_next, self.next_rank, FORWARD_TAG), (send_prev, self.prev_rank, BACKWARD_TAG)):
            if tensor is not None:
                tensor = self._checked(tensor.detach())
                ops.append(dist.P2POp(dist.isend, tensor, peer, tag=tag))
        n_sends = len(ops)
        received: list[torch.Tensor | None] = []
        for wanted, peer, tag in ((recv_prev, self.prev_rank, FORWARD_TAG), (recv_next, self.next_rank, BACKWARD_TAG)):
            buffer = torch.empty(self.tensor_shape, dtype=self.dtype, device=self.device) if wanted else None
            received.append(buffer)
            if buffer is not None:
                ops.append(dist.P2POp(dist.irecv, buffer, peer, tag=tag))
        if ops:
            works = dist.batch_isend_irecv(ops)
            if len(works) == len(ops):
                send_works, recv_works = works[:n_sends], works[n_sends:]
            else:  # a coalescing backend (NCCL) returns one work for the whole batch
                send_works, recv_works = [], works
            self._pending_sends += [(work, op.tensor) for work, op in zip(send_works, ops)]
            for work in recv_works:
                work.wait()
        self._pending_sends = [(w, t) for w, t in self._pending_sends if not w.is_completed()]
        return received[0], received[1]

    def wait_for_sends(self) -> None:
        """Block until every send posted so far has completed (call at the end of a schedule)."""
        for work, _ in self._pending_sends:
            work.wait()
        self._pending_sends = []

    def _checked(self, tensor: torch.Tensor) -> torch.Tensor:
        if tuple(tensor.shape) != self.tensor_shape or tensor.dtype != self.dtype:
            raise ValueError(
                f"a pipeline stage produced a {tuple(tensor.shape)} {tensor.dtype} tensor but the configured "
                f"pipeline tensor is {self.tensor_shape} {self.dtype} ([seq/tp if sequence parallel else seq, "
                "micro batch, hidden] from --seq-length, --micro-batch-size, --hidden-size)"
            )
        return tensor.contiguous()
