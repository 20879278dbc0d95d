"""The MoE layer that takes the MLP's place in a transformer layer (``--num-experts``, docs/moe.md).

``[s, b, h]`` (``[s / tp, b, h]`` with sequence parallelism) -> same shape:

1. sequence-parallel shards are all-gathered, so every tp rank routes the same whole micro batch (routing,
   capacity and the aux losses then do not depend on tp); the tokens are ``[T = s b, h]``;
2. the router picks k experts per token (``router.py``);
3. the dispatcher brings tokens to the expert-parallel rank holding their expert (``token_dispatcher.py``);
4. the local experts run (``experts.py``; tensor-parallel inside, summed over etp);
5. the dispatcher brings the outputs back and sums each token's k outputs weighted by the router;
6. back to ``[s, b, h]`` (this rank's sequence shard), plus the shared expert's output if any.

Which tokens a rank sends to the experts depends on the experts' layout (docs/moe.md). With expert tp = tp
(the default) every tp rank sends the whole micro batch and the experts, split over tp, sum over tp. With
``--expert-tensor-parallel-size`` other than tp, each rank sends only its own sequence shard ``[s / tp * b]``
of the routed tokens (the same rows of the routing) and gets back that shard's outputs: tp ranks may then hold
different experts, or the etp ranks of one expert different tokens (the dispatcher gathers them).

Gradient convention: like a LayerNorm's, every activation here is whole on every tp rank (the tp sums
happen inside the experts, or the slice of the routing a rank keeps all-gathers its gradient), so the
router's weight needs no tensor-parallel reduction.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from megatron_like import collectives as comm
from megatron_like.config import ModelConfig
from megatron_like.model.moe.experts import GroupedExperts
from megatron_like.model.moe.router import TopKRouter
from megatron_like.model.moe.token_dispatcher import build_dispatcher
from megatron_like.parallel_state import ParallelState
from megatron_like.tensor_parallel import gather_from_sequence_parallel_region, scatter_to_sequence_parallel_region


class MoELayer(nn.Module):
    """Router, token dispatcher, this rank's ``E / ep`` experts and an optional shared expert."""

    def __init__(self, config: ModelConfig, ps: ParallelState, layer: int, seed: int,
                 sequence_parallel: bool, dtype: torch.dtype) -> None:
        super().__init__()
        from megatron_like.model.transformer import MLP  # the shared expert is a dense MLP (no import cycle)

        self.tp_group, self.sequence_parallel = ps.tp_group, sequence_parallel
        # etp != tp: every rank brings its own sequence shard (config.py requires --sequence-parallel if tp > 1)
        self.send_own_shard = sequence_parallel and not ps.experts_split_like_tp
        if ps.tp_size > 1 and not ps.experts_split_like_tp and not sequence_parallel:
            raise ValueError("an expert tp size other than tp needs sequence parallelism (see config.py)")
        num_local = config.num_experts // ps.ep_size
        self.router = TopKRouter(config, layer, seed, dtype, ps.device, cp_group=ps.cp_group)
        self.dispatcher = build_dispatcher(config.moe_token_dispatcher_type, config.num_experts, ps)
        sum_group = ps.etp_group if ps.experts_split_like_tp else None  # else the dispatcher sums over etp
        self.experts = GroupedExperts(config, layer, seed, num_local, ps.ep_rank * num_local, sum_group,
                                      ps.etp_rank, ps.expert_tp_size, dtype, ps.device)
        self.shared_experts = None
        if config.moe_shared_expert_intermediate_size:
            shared = dataclasses.replace(config, ffn_hidden_size=config.moe_shared_expert_intermediate_size)
            self.shared_experts = MLP(shared, ps, layer, seed, sequence_parallel, dtype,
                                      name=f"layers.{layer}.mlp.shared_experts")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[s, b, h]`` (``[s / tp, b, h]`` with sequence parallelism) -> same shape and dtype."""
        full = x
        if self.sequence_parallel:  # backward keeps this rank's shard of the (whole) gradient
            full = gather_from_sequence_parallel_region(x, self.tp_group, grad_is_partial=False)
        s, b, h = full.shape
        tokens = full.reshape(s * b, h)
        probs, routing_map = self.router(tokens, num_sequences=b)
        if self.send_own_shard:  # rows [T / tp] of this rank's shard; the probs' backward all-gathers over tp
            tokens = x.reshape(-1, h)
            probs = scatter_to_sequence_parallel_region(probs, self.tp_group)
            routing_map = comm.split_along_dim(routing_map, self.tp_group, dim=0)
        expert_input, tokens_per_expert, state = self.dispatcher.dispatch(tokens, probs, routing_map)
        expert_output = self.experts(expert_input, tokens_per_expert)
        out = self.dispatcher.combine(expert_output, state).to(x.dtype).view(-1, b, h)
        if self.sequence_parallel and not self.send_own_shard:
            out = scatter_to_sequence_parallel_region(out, self.tp_group)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
