"""Tensor-parallel layers: column- and row-parallel linears and the vocab-parallel embedding.

Every layer draws its *full* weight from ``init_generator(seed, name)`` and keeps this rank's slice,
so the tp=N model holds exact slices of the tp=1 model built with the same seed (drawn in chunks of rows,
now or, at ZeRO-3, unit by unit during sharding: see ``initialization.py``).
Parameters carry two attributes the rest of the code reads:

* ``tensor_model_parallel`` (bool): the parameter is a shard; otherwise it is replicated over tp.
* ``sequence_parallel`` (bool): a replicated parameter used on sequence shards; its gradient is a
  partial sum that must be all-reduced over tp after backward.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron_like import collectives as comm
from megatron_like.collectives import Group
from megatron_like.tensor_parallel import cpu_gemm, weight_grad
from megatron_like.tensor_parallel.initialization import InitMethod, draw_slice, new_parameter
from megatron_like.tensor_parallel.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    scatter_to_tensor_parallel_region,
)
from megatron_like.tensor_parallel.random import init_generator
from megatron_like.tensor_parallel.sequence_parallel_linear import (
    sequence_parallel_column_linear,
    sequence_parallel_row_linear,
)


def mark_replicated(param: nn.Parameter, sequence_parallel: bool) -> nn.Parameter:
    """Tag a parameter that every tp rank holds whole."""
    param.tensor_model_parallel = False
    param.sequence_parallel = sequence_parallel
    return param


def sharded_parameter(
    full_shape: tuple[int, ...],
    partition_dim: int,
    tp_group: Group,
    init_method: InitMethod,
    seed: int,
    name: str,
    dtype: torch.dtype,
    device: torch.device,
) -> nn.Parameter:
    """This rank's chunk along ``partition_dim`` of the full weight drawn from its own generator."""
    tp_size, tp_rank = comm.group_size(tp_group), comm.group_rank(tp_group)
    if full_shape[partition_dim] % tp_size != 0:
        raise ValueError(f"{name}: dimension {partition_dim} of size {full_shape[partition_dim]} does not split "
                         f"over {tp_size} ranks")
    shape = list(full_shape)
    shape[partition_dim] //= tp_size

    def fill(out: torch.Tensor) -> None:
        draw_slice(out, init_method, init_generator(seed, name), full_shape, partition_dim, tp_rank, tp_size)

    param = new_parameter(tuple(shape), dtype, device, fill)
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.sequence_parallel = False
    return param


def zeros_parameter(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | None) -> nn.Parameter:
    """A zero-initialized parameter (biases, as Megatron)."""
    return new_parameter(shape, dtype, device, lambda out: out.zero_())


class ColumnParallelLinear(nn.Module):
    """Y = X A + b with A split by columns: each rank computes ``output_size / tp`` output features.

    Input ``[s, b, input_size]`` (``[s / tp, b, input_size]`` with sequence parallelism: it is
    all-gathered first, and only the shard is kept for backward, ``sequence_parallel_linear.py``).
    Output ``[s, b, output_size / tp]``, or ``[s, b, output_size]`` with ``gather_output``.
    ``weight=`` in forward supplies an external weight (the tied output layer).
    ``skip_bias_add`` leaves the bias out of the output so the caller can fuse it into what follows.
    ``gemm_backend``: ``--cpu-gemm-backend`` (MKL or oneDNN for fp32 on CPU, see ``cpu_gemm.py``).
    ``defer_weight_grad``: in a zero-bubble schedule, compute the weight gradient in the W step
    (``weight_grad.py``); False computes it during B (the output layer: its output gradient is too large to keep).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        tp_group: Group,
        init_method: InitMethod,
        seed: int,
        name: str,
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        skip_weight_param_allocation: bool = False,
        skip_bias_add: bool = False,
        gemm_backend: str = "auto",
        defer_weight_grad: bool = True,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        tp_size = comm.group_size(tp_group)
        self.gemm = cpu_gemm.resolve_backend(gemm_backend)
        self.defer_weight_grad = defer_weight_grad
        if output_size % tp_size != 0:
            raise ValueError(f"{name}: output size {output_size} does not split over {tp_size} ranks")
        self.tp_group, self.gather_output, self.sequence_parallel = tp_group, gather_output, sequence_parallel
        self.skip_bias_add = skip_bias_add
        self.input_size, self.output_size = input_size, output_size
        if skip_weight_param_allocation:
            self.weight = None
        else:
            self.weight = sharded_parameter(
                (output_size, input_size), 0, tp_group, init_method, seed, name + ".weight", dtype, device
            )
        if bias:
            # Megatron zero-initializes biases; they are sharded like the output features.
            self.bias = zeros_parameter((output_size // tp_size,), dtype, device)
            self.bias.tensor_model_parallel, self.bias.partition_dim = True, 0
            self.bias.sequence_parallel = False
        else:
            self.bias = None

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        weight = self.weight if weight is None else weight
        bias = None if self.skip_bias_add else self.bias
        if self.sequence_parallel:  # keeps only x's sequence shard for backward (and W) and gathers it again there
            y = sequence_parallel_column_linear(x, weight, bias, self.tp_group, self.gemm, self.defer_weight_grad)
        else:
            x = copy_to_tensor_parallel_region(x, self.tp_group)
            y = weight_grad.linear(x, weight, bias, self.gemm, self.defer_weight_grad)
        if self.gather_output:
            y = gather_from_tensor_parallel_region(y, self.tp_group)
        return y


class RowParallelLinear(nn.Module):
    """Y = X A + b with A split by rows: each rank multiplies its ``input_size / tp`` input features.

    Input ``[s, b, input_size / tp]`` (already split when ``input_is_parallel``). The partial products are
    all-reduced to ``[s, b, output_size]``, or reduce-scattered to ``[s / tp, b, output_size]`` with
    sequence parallelism. The bias is added once, after the reduction. ``gemm_backend`` as in
    ``ColumnParallelLinear``.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        tp_group: Group,
        init_method: InitMethod,
        seed: int,
        name: str,
        bias: bool = True,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        gemm_backend: str = "auto",
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        tp_size = comm.group_size(tp_group)
        self.gemm = cpu_gemm.resolve_backend(gemm_backend)
        if input_size % tp_size != 0:
            raise ValueError(f"{name}: input size {input_size} does not split over {tp_size} ranks")
        if sequence_parallel and not input_is_parallel:
            raise ValueError(f"{name}: sequence parallelism needs input_is_parallel=True")
        self.tp_group, self.input_is_parallel = tp_group, input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.weight = sharded_parameter(
            (output_size, input_size), 1, tp_group, init_method, seed, name + ".weight", dtype, device
        )
        if bias:
            self.bias = mark_replicated(
                zeros_parameter((output_size,), dtype, device), sequence_parallel
            )
        else:
            self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, self.tp_group)
        if self.sequence_parallel:  # a zero-bubble W step keeps the output gradient's shard and gathers it again
            y = sequence_parallel_row_linear(x, self.weight, self.tp_group, self.gemm)
        else:
            y = reduce_from_tensor_parallel_region(weight_grad.linear(x, self.weight, None, self.gemm), self.tp_group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows: rank r holds rows ``[r * v / tp, (r + 1) * v / tp)``.

    Input token ids ``[b, s]``; output ``[b, s, hidden]``: each rank looks up the ids it owns, zeros the
    rest, and the partial results are summed over tp.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        tp_group: Group,
        init_method: InitMethod,
        seed: int,
        name: str,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        tp_size = comm.group_size(tp_group)
        if num_embeddings % tp_size != 0:
            raise ValueError(f"{name}: vocabulary {num_embeddings} does not split over {tp_size} ranks")
        self.tp_group = tp_group
        self.num_embeddings = num_embeddings
        per_rank = num_embeddings // tp_size
        self.vocab_start = comm.group_rank(tp_group) * per_rank
        self.vocab_end = self.vocab_start + per_rank
        self.weight = sharded_parameter(
            (num_embeddings, embedding_dim), 0, tp_group, init_method, seed, name + ".weight", dtype, device
        )

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_embedding(token_ids, self.weight, self.tp_group)


def vocab_parallel_embedding(token_ids: torch.Tensor, weight: torch.Tensor, tp_group: Group) -> torch.Tensor:
    """Look ids ``[b, s]`` up in this tp rank's rows ``[v / tp, h]`` of a vocabulary-split table -> ``[b, s, h]``,
    summed over tp (any table split like VocabParallelEmbedding's: the last stage's tied copy too)."""
    if tp_group is None:
        return weight_grad.embedding(token_ids, weight)
    vocab_start = comm.group_rank(tp_group) * weight.shape[0]
    outside = (token_ids < vocab_start) | (token_ids >= vocab_start + weight.shape[0])
    local_ids = (token_ids - vocab_start).masked_fill(outside, 0)
    partial = weight_grad.embedding(local_ids, weight).masked_fill(outside.unsqueeze(-1), 0.0)
    return reduce_from_tensor_parallel_region(partial, tp_group)
