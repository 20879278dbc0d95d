"""The experts this rank holds: ``E_local`` MLPs stored as two stacked weights (Megatron-LM's GroupedMLP).

``weight1 [E_local, h, F1 / etp]`` (F1 = ffn, or 2 ffn of interleaved (gate, up) pairs with ``--swiglu``) and
``weight2 [E_local, ffn / etp, h]``: expert e computes ``act(x @ weight1[e]) @ weight2[e]`` on its contiguous
block of the permuted tokens. Each expert is split over expert tensor parallelism (``etp``, by default tp) like
the dense MLP (column-split first matmul, row-split second); its values are expert e's slice of the weight the
single-process model draws from the generator named ``layers.<l>.mlp.experts.<e>.fc1.weight`` (``fc2``),
whatever the layout. The output is this rank's partial sum over the etp ranks: with etp = tp the experts sum it
themselves (``sum_group``, every tp rank holds the same tokens); otherwise the dispatcher reduce-scatters it.

``grouped_matmul`` is where ``--moe-grouped-gemm`` switches to the grouped GEMM kernel
(``megatron_like.kernels.grouped_gemm.grouped_gemm``: one call for all experts); without it, one matmul per expert.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megatron_like.collectives import Group
from megatron_like.config import ModelConfig
from megatron_like.kernels import fused_swiglu
from megatron_like.kernels.grouped_gemm import grouped_gemm
from megatron_like.tensor_parallel import (
    copy_to_tensor_parallel_region,
    init_generator,
    new_parameter,
    normal_init,
    reduce_from_tensor_parallel_region,
    weight_grad,
)
from megatron_like.tensor_parallel.initialization import draw_slice


def grouped_matmul(x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor,
                   use_grouped_gemm: bool) -> torch.Tensor:
    """``x [T, k]`` in expert blocks of ``tokens_per_expert [E]`` rows, ``weight [E, k, n]`` -> ``[T, n]``."""
    # Inside a zero-bubble schedule the weight gradient waits for the W step (tensor_parallel/weight_grad.py).
    return weight_grad.grouped_matmul(x, weight, tokens_per_expert,
                                      _grouped_gemm_kernel if use_grouped_gemm else _matmul_per_expert)


def _grouped_gemm_kernel(x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    return grouped_gemm(x, weight, tokens_per_expert.cpu())  # the group sizes are read on the host


def _matmul_per_expert(x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    blocks = x.split(tokens_per_expert.tolist())
    return torch.cat([block @ weight[e] for e, block in enumerate(blocks)])


class GroupedExperts(nn.Module):
    """``E / ep`` experts of one MoE layer on this rank: ``[M, h]`` expert-major tokens -> ``[M, h]``.

    ``etp_rank``/``etp_size`` pick this rank's slice of each expert; ``sum_group`` is the group the partial
    outputs are all-reduced over here (the etp group when its ranks hold the same tokens, else None).
    """

    def __init__(self, config: ModelConfig, layer: int, seed: int, num_local: int, first_expert: int,
                 sum_group: Group, etp_rank: int, etp_size: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        h, ffn = config.hidden_size, config.moe_ffn_size
        self.swiglu, self.sum_group = config.swiglu, sum_group
        self.use_grouped_gemm = config.moe_grouped_gemm
        fc1_rows = 2 * ffn if config.swiglu else ffn
        std, scaled_std = config.init_method_std, config.init_method_std / math.sqrt(2.0 * config.num_layers)
        experts = range(first_expert, first_expert + num_local)

        def fill(out: torch.Tensor, name: str, full_shape: tuple[int, int], partition_dim: int, std: float) -> None:
            # out [E_local, in, out / etp] holds the transposed etp slice of each expert's linear weight [out, in]
            for local, expert in enumerate(experts):
                piece = torch.empty(out.shape[2], out.shape[1], dtype=out.dtype, device=out.device)
                generator = init_generator(seed, f"layers.{layer}.mlp.experts.{expert}.{name}.weight")
                draw_slice(piece, normal_init(std), generator, full_shape, partition_dim, etp_rank, etp_size)
                out[local].copy_(piece.t())

        self.weight1 = new_parameter((num_local, h, fc1_rows // etp_size), dtype, device,
                                     lambda out: fill(out, "fc1", (fc1_rows, h), 0, std))
        self.weight2 = new_parameter((num_local, ffn // etp_size, h), dtype, device,
                                     lambda out: fill(out, "fc2", (h, ffn), 1, scaled_std))
        for weight, split_dim in ((self.weight1, 2), (self.weight2, 1)):
            weight.tensor_model_parallel, weight.partition_dim = True, split_dim  # split over etp (maybe 1)
            weight.sequence_parallel = False
            weight.expert_parallel = True  # reduced over the expert-data-parallel group (distributed/buffers.py)

    def forward(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """``tokens [M, h]`` in blocks of ``tokens_per_expert [E_local]`` -> ``[M, h]`` (summed over ``sum_group``)."""
        tokens = copy_to_tensor_parallel_region(tokens, self.sum_group)  # backward: sum the ranks' partial grads
        hidden = grouped_matmul(tokens, self.weight1, tokens_per_expert, self.use_grouped_gemm)
        hidden = fused_swiglu(hidden) if self.swiglu else F.gelu(hidden, approximate="tanh")
        partial = grouped_matmul(hidden, self.weight2, tokens_per_expert, self.use_grouped_gemm)
        return reduce_from_tensor_parallel_region(partial, self.sum_group)
