"""Auxiliary-loss-free balancing (``--moe-router-enable-expert-bias``, DeepSeek-V3): the step that moves each
router's expert bias after the optimizer step, identically on every rank.

Each router counted, during the step's forwards, the tokens it routed to each expert (``tokens_per_expert``,
router.py). The bias must follow the load of the whole global batch, so the counts are summed over the
data-parallel x context-parallel group of the stage (the ranks that routed other tokens: other samples, or other
chunks of the same sequences; expert-parallel ranks are data-parallel ranks and route their own tokens) and every
rank applies the same update to the same sums:
``bias += rate * sign(mean load - load)``. Tensor-parallel ranks route the same gathered micro batch (the MoE
layer gathers sequence-parallel shards before routing, moe_layer.py), so their counts are already equal and are
not summed over tp (that would count each token tp times; the sign, and so the update, would be the same).
Pipeline stages hold different layers: each updates its own. One all-reduce carries every layer of the rank.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron_like import collectives as comm
from megatron_like.model.moe.router import TopKRouter
from megatron_like.parallel_state import ParallelState


def routers_with_expert_bias(model: list[nn.Module]) -> list[TopKRouter]:
    """The routers of the chunks that hold an expert bias, in chunk and layer order."""
    return [m for chunk in model for m in chunk.modules() if isinstance(m, TopKRouter) and m.expert_bias is not None]


def update_expert_biases(model: list[nn.Module], ps: ParallelState) -> dict[int, torch.Tensor]:
    """Update every expert bias of ``model`` from this step's token counts (collective over the dp x cp group);
    return ``{global layer: bias [E]}`` after the update (empty without expert bias)."""
    routers = routers_with_expert_bias(model)
    if not routers:
        return {}
    counts = torch.stack([router.tokens_per_expert for router in routers])  # [layers, E]
    comm.all_reduce(counts, ps.dp_cp_group)
    for router, layer_counts in zip(routers, counts):
        router.update_expert_bias(layer_counts)
    return {router.layer: router.expert_bias.detach().clone() for router in routers}
