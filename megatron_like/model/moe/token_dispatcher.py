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

Expert tensor parallelism other than tp (``--expert-tensor-parallel-size``, docs/moe.md): every rank then
brings its own tokens, and the ``etp`` ranks holding slices of the same experts must all see each other's.
``allgather`` gathers over the ``etp x ep`` ranks instead of the ``ep`` ranks (the reduce-scatter then sums
the etp partial outputs too); ``alltoall`` follows its all-to-all with an all-gather of the received pairs over
the etp group and precedes the reverse all-to-all with a reduce-scatter of the partial outputs (Megatron-core's
alltoall dispatcher). With etp = tp, the etp ranks hold the same tokens and the experts sum over tp themselves.

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
from megatron_like.parallel_state import ParallelState
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


def gather_rows(x: torch.Tensor, rows: list[int], group: Group) -> torch.Tensor:
    """All-gather of uneven row blocks: ``x [rows[me], h]`` -> ``[sum(rows), h]``, rank j's block j-th.

    An all-to-all sending ``x`` to every rank (gloo's all-gather needs equal sizes); backward: each rank's
    gradient of block ``me`` comes back and the copies' gradients are summed (a reduce-scatter).
    """
    world, mine = len(rows), rows[comm.group_rank(group)]
    return _AllToAll.apply(x.repeat(world, 1), group, rows, [mine] * world)


def reduce_scatter_rows(x: torch.Tensor, rows: list[int], group: Group) -> torch.Tensor:
    """Reduce-scatter of uneven row blocks, the mirror of :func:`gather_rows`: ``x [sum(rows), h]`` partial
    sums -> ``[rows[me], h]``, block ``me`` summed over the ranks."""
    world, mine = len(rows), rows[comm.group_rank(group)]
    return _AllToAll.apply(x, group, [mine] * world, rows).view(world, mine, -1).sum(0)


@dataclass
class _Combine:
    """What ``combine`` needs from ``dispatch`` (one micro batch's routing)."""

    token_index: torch.Tensor  # [N] row of each permuted pair in the (gathered) token list
    weights: torch.Tensor  # [N] its router probability
    num_tokens: int
    sort_index: torch.Tensor | None = None  # all-to-all: how received blocks were regrouped by expert
    input_splits: list[int] | None = None
    output_splits: list[int] | None = None
    etp_rows: list[int] | None = None  # all-to-all with etp != tp: pairs each etp rank received over ep


class AllGatherDispatcher:
    """All-gather tokens over the group holding one copy of every expert, compute local experts, reduce-scatter
    outputs. The group is the ep group (etp = tp), or the ``etp x ep`` ranks (each bringing its own tokens)."""

    def __init__(self, num_experts: int, group: Group, ep_rank: int, ep_size: int) -> None:
        self.group = group
        per_rank = num_experts // ep_size
        self.local = slice(ep_rank * per_rank, (ep_rank + 1) * per_rank)

    def dispatch(self, tokens: torch.Tensor, probs: torch.Tensor,
                 routing_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, _Combine]:
        # Every rank's experts contribute to every gathered token's gradient: the backward sums them.
        tokens = gather_from_sequence_parallel_region(tokens, self.group, grad_is_partial=True)  # [G T, h]
        probs = gather_from_sequence_parallel_region(probs, self.group, grad_is_partial=True)
        routing_map = comm.all_gather_along_dim(routing_map.to(torch.uint8), self.group, dim=0).bool()
        local_map, local_probs = routing_map[:, self.local], probs[:, self.local]
        permuted, token_index, tokens_per_expert = permute(tokens, local_map)
        return permuted, tokens_per_expert, _Combine(token_index, permuted_probs(local_probs, local_map),
                                                     tokens.shape[0])

    def combine(self, expert_output: torch.Tensor, state: _Combine) -> torch.Tensor:
        out = unpermute(expert_output, state.token_index, state.weights, state.num_tokens)  # [G T, h] partial
        return reduce_scatter_to_sequence_parallel_region(out, self.group)  # [T, h]


class AllToAllDispatcher:
    """Send each (token, expert) pair to the rank holding the expert; bring the outputs back the same way.

    ``etp_group`` (None when etp = tp or etp = 1): the ranks holding slices of the same experts, each with its
    own tokens; the pairs received over ep are all-gathered over it and the partial outputs reduce-scattered.
    """

    def __init__(self, num_experts: int, ep_group: Group, ep_rank: int, ep_size: int, etp_group: Group) -> None:
        self.ep_group, self.ep_size, self.etp_group = ep_group, ep_size, etp_group
        self.per_rank = num_experts // ep_size

    def dispatch(self, tokens: torch.Tensor, probs: torch.Tensor,
                 routing_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, _Combine]:
        permuted, token_index, tokens_per_expert = permute(tokens, routing_map)  # expert-major, all E experts
        state = _Combine(token_index, permuted_probs(probs, routing_map), tokens.shape[0])
        if self.ep_group is None and self.etp_group is None:
            return permuted, tokens_per_expert, state
        received, recv_counts = permuted, tokens_per_expert.view(1, -1)  # [sources, E_local] (ep 1: all E local)
        if self.ep_group is not None:
            send_counts = tokens_per_expert.view(self.ep_size, self.per_rank)  # row j: pairs for rank j's experts
            blocks = [self.per_rank] * self.ep_size
            recv_counts = comm.all_to_all(tokens_per_expert, blocks, blocks, self.ep_group).view(self.ep_size,
                                                                                                 self.per_rank)
            state.input_splits, state.output_splits = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()
            received = _AllToAll.apply(permuted, self.ep_group, state.output_splits, state.input_splits)
        if self.etp_group is not None:  # the etp ranks' received pairs, one block per etp rank: [etp ep, E_local]
            per_etp_rank = comm.all_gather_along_dim(recv_counts.reshape(1, -1), self.etp_group, dim=0)
            state.etp_rows = per_etp_rank.sum(1).tolist()
            received = gather_rows(received, state.etp_rows, self.etp_group)
            recv_counts = per_etp_rank.view(-1, self.per_rank)
        expert_input, state.sort_index = sort_chunks(received, recv_counts)  # source-major -> expert-major
        return expert_input, recv_counts.sum(0), state

    def combine(self, expert_output: torch.Tensor, state: _Combine) -> torch.Tensor:
        if state.sort_index is not None:
            expert_output = unsort_chunks(expert_output, state.sort_index)
        if self.etp_group is not None:  # sum the etp ranks' partial outputs, keep this rank's pairs
            expert_output = reduce_scatter_rows(expert_output, state.etp_rows, self.etp_group)
        if self.ep_group is not None:
            expert_output = _AllToAll.apply(expert_output, self.ep_group, state.input_splits, state.output_splits)
        return unpermute(expert_output, state.token_index, state.weights, state.num_tokens)


def build_dispatcher(kind: str, num_experts: int, ps: ParallelState) -> AllGatherDispatcher | AllToAllDispatcher:
    """``--moe-token-dispatcher-type`` -> its dispatcher for this rank's expert layout."""
    if kind == "allgather":
        group = ps.ep_group if ps.experts_split_like_tp else ps.expert_tp_ep_group
        return AllGatherDispatcher(num_experts, group, ps.ep_rank, ps.ep_size)
    etp_group = None if ps.experts_split_like_tp else ps.etp_group
    return AllToAllDispatcher(num_experts, ps.ep_group, ps.ep_rank, ps.ep_size, etp_group)
