"""Which virtual pipeline stage each model chunk of each rank is, and where a step's result goes.

A model of ``pp * vp`` equal blocks of layers (virtual stages ``0 .. pp*vp - 1``) is spread over ``pp``
ranks, ``vp`` chunks each, in one of two ways:

* **ring** (1F1B, interleaved 1F1B, ZB-H1; Megatron's): chunk ``c`` of rank ``r`` is stage ``c * pp + r``.
  Activations always go to rank ``r + 1`` (the last rank feeds chunk ``c + 1`` of rank 0), gradients to
  ``r - 1``; the last stage (the loss) is on the last rank.
* **V** (ZB-V, DualPipeV; ``vp = 2``): chunk 0 of rank ``r`` is stage ``r`` and chunk 1 is stage
  ``2 pp - 1 - r``. Activations go down the ranks on chunk 0 and back up on chunk 1; the last rank hands
  chunk 0's output to its own chunk 1 (and chunk 1's input gradient to its chunk 0) without a message, and
  both the first stage (the embedding) and the last (the loss) are on rank 0::

      pp = 3, stages:   rank 0: 0 . . . . 5      (chunk 0 = stage 0, chunk 1 = stage 5)
                        rank 1: . 1 . . 4 .
                        rank 2: . . 2 3 . .

Imports nothing from the package, so the model (``model/gpt.py::chunk_layers``) can use it.
"""

from __future__ import annotations

from typing import NamedTuple

# Messages between stages carry one of two tags (p2p.py): activations and their gradients.
ACTIVATION_TAG = 0
GRADIENT_TAG = 1


def virtual_stage(pp_size: int, pp_rank: int, vp_size: int = 1, vp_rank: int = 0, v_shape: bool = False) -> int:
    """The virtual stage (block of layers) of chunk ``vp_rank`` on rank ``pp_rank``, ring or V placement."""
    if v_shape:
        if vp_size != 2:
            raise ValueError(f"the V placement has 2 chunks per rank, got {vp_size}")
        return pp_rank if vp_rank == 0 else 2 * pp_size - 1 - pp_rank
    return vp_rank * pp_size + pp_rank


class Link(NamedTuple):
    """Where a step's result goes (or its input comes from): ``peer`` is the pipeline-rank offset of the
    other rank (+1 next, -1 previous, 0 this rank: a local hand-off without a message), ``tag`` is
    ACTIVATION_TAG or GRADIENT_TAG, ``chunk`` the chunk on the other side."""

    peer: int
    tag: int
    chunk: int


class ChunkPlacement(NamedTuple):
    """The placement of ``vp_size`` chunks on each of ``pp_size`` ranks (ring, or V when ``v_shape``)."""

    pp_size: int
    vp_size: int = 1
    v_shape: bool = False

    @property
    def num_stages(self) -> int:
        return self.pp_size * self.vp_size

    def stage(self, pp_rank: int, chunk: int) -> int:
        return virtual_stage(self.pp_size, pp_rank, self.vp_size, chunk, self.v_shape)

    def holder(self, stage: int) -> tuple[int, int]:
        """``(pp_rank, chunk)`` holding virtual stage ``stage``."""
        if self.v_shape:
            return (stage, 0) if stage < self.pp_size else (2 * self.pp_size - 1 - stage, 1)
        chunk, pp_rank = divmod(stage, self.pp_size)
        return pp_rank, chunk

    def is_first(self, pp_rank: int, chunk: int) -> bool:
        """This chunk is stage 0: it embeds the tokens."""
        return self.stage(pp_rank, chunk) == 0

    def is_last(self, pp_rank: int, chunk: int) -> bool:
        """This chunk is the last stage: it computes the loss."""
        return self.stage(pp_rank, chunk) == self.num_stages - 1

    def result_link(self, pp_rank: int, kind: str, chunk: int) -> Link | None:
        """Where the result of a ``kind`` step on this chunk goes: a forward's output to the next stage, a
        backward's input gradient to the previous one; None from the last stage's forward (the loss) and
        the first stage's backward, and for W steps (nothing leaves them)."""
        if kind == "W":
            return None
        stage = self.stage(pp_rank, chunk) + (1 if kind == "F" else -1)
        if not 0 <= stage < self.num_stages:
            return None
        other_rank, other_chunk = self.holder(stage)
        offset = (other_rank - pp_rank) % self.pp_size
        peer = 0 if offset == 0 else (1 if offset == 1 else -1)
        if self.pp_size == 2 and offset == 1:  # the one neighbour is both +1 and -1: name it by the direction
            peer = 1 if (kind == "F") != (self.v_shape and chunk == 1) else -1
        return Link(peer, ACTIVATION_TAG if kind == "F" else GRADIENT_TAG, other_chunk)

    def input_holder(self, pp_rank: int, kind: str, chunk: int) -> tuple[int, int] | None:
        """The (rank, chunk) whose ``kind`` step makes the input of this rank's ``kind`` step on ``chunk``: the
        previous stage for a forward, the next one for a backward; None at the ends and for W steps."""
        if kind == "W":
            return None
        stage = self.stage(pp_rank, chunk) + (-1 if kind == "F" else 1)
        return self.holder(stage) if 0 <= stage < self.num_stages else None

    def input_link(self, pp_rank: int, kind: str, chunk: int) -> Link | None:
        """Where the input of a ``kind`` step on this chunk comes from (the mirror of :meth:`result_link`):
        a forward's from the previous stage, a backward's output gradient from the next one."""
        holder = self.input_holder(pp_rank, kind, chunk)
        if holder is None:
            return None
        other_rank, other_chunk = holder
        sent = self.result_link(other_rank, kind, other_chunk)
        return Link(-sent.peer, sent.tag, other_chunk)
