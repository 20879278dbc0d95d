"""Getting each token to the rank that holds its expert, and the expert outputs back.

The ``ep`` ranks of an expert-parallel group each hold ``E / ep`` consecutive experts (rank r: experts
``r * E/ep ..``) and route their own tokens. Two ways to bring tokens and experts together
(``--moe-token-dispatcher-type``):

* ``allgather``: every rank all-gathers the group's tokens, probabilities and routing maps, runs its local
  experts on the tokens routed to them, and a reduce-scatter sums the partial outputs back to the ranks the
  tokens came from. Simple; moves every token to every rank.
* ``alltoall``: each rank sorts its routed (token, expert) pairs by expert and sends each rank exactly the
  pairs for its experts (one all-to-all for the counts, one for the tokens); the outputs come back by the
  reverse all-to-all and are weighted and summed on the source rank. Moves ``T * k`` rows.

``dispatch`` returns the local experts' input ``[M, h]`` (expert-major), ``tokens_per_expert [E_local]`` and
what ``combine`` needs; ``combine`` takes the experts' output ``[M, h]`` and returns ``[T, h]`` fp32. Both are
differentiable (the collectives are autograd functions whose backward is their mirror image).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_like import collectives as comm
from megatron_like.collectives import Group
from megatron_like.model.moe.permutation import permute, permuted_probs, sort_chunks, unpermute, unsort_chunks
from megatron_like.tensor_parallel import (
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)


class _AllToAll(torch.autograd.Function):
    """Forward: all-to-all with these splits. Backward: the all-to-all with the splits swapped."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, output_splits: list[int], input_splits: list[int]) -> torch.Tensor:
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        return comm.all_to_all(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return comm.all_to_all(grad, ctx.input_splits, ctx.output_splits, ctx.group), None, None, None


@dataclass
class _Combine:
    """What ``combine`` needs from ``dispatch`` (one micro batch's routing)."""

    token_index: torch.Tensor  # [N] row of each permuted pair in the (gathered) token list
    weights: torch.Tensor  # [N] its router probability
    num_tokens: int
    sort_index: torch.Tensor | None = None  # all-to-all: how received blocks were regrouped by expert
    input_splits: list[int] | None = None
    output_splits: list[int] | None = None


class AllGatherDispatcher:
    """All-gather tokens over the expert-parallel group, compute local experts, reduce-scatter outputs."""

    def __init__(self, num_experts: int, ep_group: Group, ep_rank: int, ep_size: int) -> None:
        self.ep_group = ep_group
        per_rank = num_experts // ep_size
        self.local = slice(ep_rank * per_rank, (ep_rank + 1) * per_rank)

    def dispatch(self, tokens: torch.Tensor, probs: torch.Tensor,
                 routing_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, _Combine]:
        # Every rank's experts contribute to every gathered token's gradient: the backward sums them.
        tokens = gather_from_sequence_parallel_region(tokens, self.ep_group, grad_is_partial=True)  # [ep T, h]
        probs = gather_from_sequence_parallel_region(probs, self.ep_group, grad_is_partial=True)
        routing_map = comm.all_gather_along_dim(routing_map.to(torch.uint8), self.ep_group, dim=0).bool()
        local_map, local_probs = routing_map[:, self.local], probs[:, self.local]
        permuted, token_index, tokens_per_expert = permute(tokens, local_map)
        return permuted, tokens_per_expert, _Combine(token_index, permuted_probs(local_probs, local_map),
                                                     tokens.shape[0])

    def combine(self, expert_output: torch.Tensor, state: _Combine) -> torch.Tensor:
        out = unpermute(expert_output, state.token_index, state.weights, state.num_tokens)  # [ep T, h] partial
        return reduce_scatter_to_sequence_parallel_region(out, self.ep_group)  # [T, h]


class AllToAllDispatcher:
    """Send each (token, expert) pair to the rank holding the expert; bring the outputs back the same way."""

    def __init__(self, num_experts: int, ep_group: Group, ep_rank: int, ep_size: int) -> None:
        self.ep_group, self.ep_size = ep_group, ep_size
        self.per_rank = num_experts // ep_size

    def dispatch(self, tokens: torch.Tensor, probs: torch.Tensor,
                 routing_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, _Combine]:
        permuted, token_index, tokens_per_expert = permute(tokens, routing_map)  # expert-major, all E experts
        state = _Combine(token_index, permuted_probs(probs, routing_map), tokens.shape[0])
        if self.ep_group is None:
            return permuted, tokens_per_expert, state
        send_counts = tokens_per_expert.view(self.ep_size, self.per_rank)  # row j: pairs for rank j's experts
        blocks = [self.per_rank] * self.ep_size
        recv_counts = comm.all_to_all(tokens_per_expert, blocks, blocks, self.ep_group).view(self.ep_size,
                                                                                             self.per_rank)
        state.input_splits, state.output_splits = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()
        received = _AllToAll.apply(permuted, self.ep_group, state.output_splits, state.input_splits)
        expert_input, state.sort_index = sort_chunks(received, recv_counts)  # source-major -> expert-major
        return expert_input, recv_counts.sum(0), state

    def combine(self, expert_output: torch.Tensor, state: _Combine) -> torch.Tensor:
        if self.ep_group is not None:
            expert_output = unsort_chunks(expert_output, state.sort_index)
            expert_output = _AllToAll.apply(expert_output, self.ep_group, state.input_splits, state.output_splits)
        return unpermute(expert_output, state.token_index, state.weights, state.num_tokens)


def build_dispatcher(kind: str, num_experts: int, ep_group: Group, ep_rank: int,
                     ep_size: int) -> AllGatherDispatcher | AllToAllDispatcher:
    """``--moe-token-dispatcher-type`` -> its dispatcher."""
    cls = {"allgather": AllGatherDispatcher, "alltoall": AllToAllDispatcher}[kind]
    return cls(num_experts, ep_group, ep_rank, ep_size)
