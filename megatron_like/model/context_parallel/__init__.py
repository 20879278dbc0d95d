"""Context parallelism: each sequence split over ``--context-parallel-size`` ranks (docs/context_parallel.md).

``layout.py``: which tokens a cp rank holds (load-balanced chunks) and the whole sequence's loss;
``attention.py``: attention across the cp ranks (``--cp-comm-type``); ``ring.py``: the ring (p2p) mode.
"""

from megatron_like.model.context_parallel.attention import context_parallel_attention
from megatron_like.model.context_parallel.layout import (
    cp_positions,
    cp_rotary_tables,
    gather_sequence,
    sequence_mean_loss,
    split_batch,
    split_for_context_parallel,
)
from megatron_like.model.context_parallel.ring import Ring, ring_attention

__all__ = ["Ring", "context_parallel_attention", "cp_positions", "cp_rotary_tables", "gather_sequence",
           "ring_attention", "sequence_mean_loss", "split_batch", "split_for_context_parallel"]
