"""Tensor-parallel building blocks (Megatron-core's ``tensor_parallel`` package, layered the same way)."""

from megatron_like.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_like.tensor_parallel.initialization import (
    deferred_init,
    load_initial_values,
    new_parameter,
    normal_init,
    xavier_uniform_init,
)
from megatron_like.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    mark_replicated,
    vocab_parallel_embedding,
    zeros_parameter,
)
from megatron_like.tensor_parallel.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
)
from megatron_like.tensor_parallel.random import get_rng_tracker, init_generator, seed_everything

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "copy_to_tensor_parallel_region",
    "deferred_init",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_parallel_region",
    "get_rng_tracker",
    "init_generator",
    "load_initial_values",
    "mark_replicated",
    "new_parameter",
    "normal_init",
    "reduce_from_tensor_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_parallel_region",
    "seed_everything",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_embedding",
    "xavier_uniform_init",
    "zeros_parameter",
]
