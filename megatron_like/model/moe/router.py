"""The router: which experts each token goes to, with what weight, and the losses that balance them.

Input: the tokens of one micro batch, ``[T, h]`` (the whole sequence: the MoE layer gathers sequence-parallel
shards first, so routing and capacity see the same tokens at every tp size). Output: ``probs [T, E]`` fp32
(the weight of each chosen expert, 0 elsewhere) and ``routing_map [T, E]`` bool (True where a token goes).

Top-k (``--moe-router-topk k``), in one of Megatron-LM's two orders:

* default: the k largest logits, then a softmax over those k (the weights sum to 1; Mixtral);
* ``--moe-router-pre-softmax``: softmax over all E experts, then the k largest probabilities (they do not
  sum to 1; the original Switch/GShard form).

Load balancing (``--moe-router-load-balancing-type``):

* ``aux_loss``: the Switch Transformer loss ``E * sum_e f_e * P_e``, ``f_e`` the fraction of the T*k
  assignments that went to expert e (before dropping), ``P_e`` the mean softmax probability of e over the
  tokens. It is 1 for a perfectly uniform router, ``E`` when everything goes to one expert. Megatron-LM's
  formula is this divided by k. Added with weight ``--moe-aux-loss-coeff``.
* ``sinkhorn``: experts chosen by the top-k of Sinkhorn-balanced scores (rows and columns of ``exp(logits)``
  rescaled until each expert carries the same total; no loss), weighted by sigmoid (k = 1) or softmax of the
  raw logits (Megatron-LM's rule). In eval, plain top-k.
* ``none``.

``--moe-z-loss-coeff``: ST-MoE's ``mean_t logsumexp(logits_t)^2`` keeps logits small.

Capacity (``--moe-expert-capacity-factor c``): each expert takes at most ``ceil(c * T * k / E)`` of the
micro batch's assignments (at most T); the rest are dropped (the token gets nothing from that expert). Which
ones stay is ``--moe-token-drop-policy``: the highest probabilities, or the earliest tokens; ties go to the
earlier token (a stable sort), so dropping is deterministic. ``--moe-pad-expert-input-to-capacity`` fills
every expert up to exactly the capacity with tokens not routed to it, at weight 0 (Megatron-LM's trick).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megatron_like import collectives as comm
from megatron_like.config import ModelConfig
from megatron_like.model.moe.aux_losses import attach_aux_loss, record_aux_loss
from megatron_like.tensor_parallel import init_generator, mark_replicated, new_parameter, normal_init
from megatron_like.tensor_parallel.initialization import draw_slice
from megatron_like.tensor_parallel.random import is_recomputing


def topk_softmax(logits: torch.Tensor, topk: int, pre_softmax: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [T, E]`` -> weights and expert indices ``[T, k]`` (see the module docstring for the order)."""
    if pre_softmax:
        return torch.topk(torch.softmax(logits, dim=-1), k=topk, dim=-1)
    top_logits, indices = torch.topk(logits, k=topk, dim=-1)
    return torch.softmax(top_logits, dim=-1), indices


def sinkhorn(logits: torch.Tensor, tol: float = 1e-4, max_iters: int = 1000) -> torch.Tensor:
    """Balanced scores ``[T, E]``: ``exp(logits)`` with rows scaled to sum to 1/T and columns to 1/E (alternating
    until the column scales move less than ``tol`` on average)."""
    cost = torch.exp(logits - logits.max())  # the max cancels in the normalization; it only avoids overflow
    tokens, experts = cost.shape
    col = torch.ones(experts, dtype=cost.dtype, device=cost.device)
    for _ in range(max_iters):
        row = 1.0 / (tokens * (cost @ col) + 1e-8)
        new_col = 1.0 / (experts * (row @ cost) + 1e-8)
        converged = (new_col - col).abs().mean() < tol
        col = new_col
        if converged:
            break
    return cost * row[:, None] * col[None, :]


def switch_load_balancing_loss(scores: torch.Tensor, routing_map: torch.Tensor, topk: int,
                               cp_group: comm.Group = None) -> torch.Tensor:
    """``E * sum_e f_e * P_e``: ``scores [T, E]`` softmax over all experts, ``routing_map [T, E]`` before dropping.

    With context parallelism (``cp_group``) the counts ``f_e`` are the whole sequence's (summed over cp) and ``P_e``
    this rank's: the loss is linear in ``P_e``, so the mean of the cp ranks' losses (the dp x cp gradient average
    and the logged mean) is the whole sequence's loss.
    """
    tokens, experts = scores.shape
    counts = torch.cat([routing_map.sum(dim=0).float(), scores.new_full((1,), float(tokens))])
    comm.all_reduce(counts, cp_group)
    fraction_routed = counts[:-1] / (counts[-1] * topk)  # f_e, no gradient (a count)
    mean_prob = scores.mean(dim=0)  # P_e
    return experts * (fraction_routed * mean_prob).sum()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """``mean_t logsumexp(logits_t)^2`` (ST-MoE)."""
    return torch.logsumexp(logits, dim=-1).square().mean()


def expert_capacity(num_tokens: int, num_experts: int, topk: int, capacity_factor: float) -> int:
    """Assignments one expert takes from a micro batch of ``num_tokens`` tokens (at most every token once)."""
    return min(num_tokens, math.ceil(capacity_factor * num_tokens * topk / num_experts))


def drop_over_capacity(probs: torch.Tensor, routing_map: torch.Tensor, capacity: int, policy: str,
                       pad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep at most ``capacity`` tokens per expert (exactly ``capacity`` with ``pad``): ``[T, E]`` -> ``[T, E]``."""
    tokens = probs.shape[0]
    if policy == "probs":
        priority = torch.where(routing_map, probs, -1.0)  # routed tokens first, best first
    else:  # "position": routed tokens first, earliest first
        earliness = torch.arange(tokens, 0, -1, device=probs.device, dtype=probs.dtype)[:, None]
        priority = torch.where(routing_map, earliness, 0.0)
    chosen = torch.sort(priority.detach(), dim=0, descending=True, stable=True).indices[:capacity]  # [C, E]
    keep = torch.zeros_like(routing_map).scatter_(0, chosen, True)
    if not pad:
        keep &= routing_map  # a padded slot is an unrouted token: its weight stays 0
    return probs * keep, keep


class TopKRouter(nn.Module):
    """Scores ``[T, h]`` tokens against E experts (weight ``[E, h]``, replicated over tp) and routes them."""

    def __init__(self, config: ModelConfig, layer: int, seed: int, dtype: torch.dtype,
                 device: torch.device, cp_group: comm.Group = None) -> None:
        super().__init__()
        self.layer, self.cp_group = layer, cp_group
        self.num_experts, self.topk = config.num_experts, config.moe_router_topk
        self.pre_softmax = config.moe_router_pre_softmax
        self.balancing = config.moe_router_load_balancing_type
        self.aux_loss_coeff, self.z_loss_coeff = config.moe_aux_loss_coeff, config.moe_z_loss_coeff
        self.capacity_factor = config.moe_expert_capacity_factor
        self.drop_policy, self.pad_to_capacity = config.moe_token_drop_policy, config.moe_pad_expert_input_to_capacity
        shape = (config.num_experts, config.hidden_size)

        def draw(out: torch.Tensor) -> None:
            generator = init_generator(seed, f"layers.{layer}.mlp.router.weight")
            draw_slice(out, normal_init(config.init_method_std), generator, shape)

        # Every tp rank routes the same (gathered) tokens, so its gradient is whole: not a sequence-parallel param.
        self.weight = mark_replicated(new_parameter(shape, dtype, device, draw), sequence_parallel=False)

    def _record(self, name: str, value: torch.Tensor) -> None:
        if not is_recomputing():  # a recomputed forward must not count its micro batch twice
            record_aux_loss(name, self.layer, value)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``tokens [T, h]`` -> ``probs [T, E]`` fp32 and ``routing_map [T, E]`` bool."""
        logits = F.linear(tokens.float(), self.weight.float())  # routing decisions in fp32
        training = self.training
        if self.z_loss_coeff is not None and training:
            loss = z_loss(logits)
            self._record("z_loss", loss)
            logits = attach_aux_loss(logits, self.z_loss_coeff * loss)
        if self.balancing == "sinkhorn" and training:
            with torch.no_grad():
                indices = torch.topk(sinkhorn(logits), k=self.topk, dim=-1).indices
            activation = torch.sigmoid(logits) if self.topk == 1 else torch.softmax(logits, dim=-1)
            weights = activation.gather(1, indices)
        elif self.balancing == "sinkhorn":
            activation = torch.sigmoid(logits) if self.topk == 1 else torch.softmax(logits, dim=-1)
            weights, indices = torch.topk(activation, k=self.topk, dim=-1)
        else:
            weights, indices = topk_softmax(logits, self.topk, self.pre_softmax)
        probs = torch.zeros_like(logits).scatter(1, indices, weights)
        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, indices, True)
        if self.balancing == "aux_loss" and training:
            loss = switch_load_balancing_loss(torch.softmax(logits, dim=-1), routing_map, self.topk, self.cp_group)
            self._record("load_balancing_loss", loss)
            if self.aux_loss_coeff > 0:
                probs = attach_aux_loss(probs, self.aux_loss_coeff * loss)
        if self.capacity_factor is not None:
            capacity = expert_capacity(tokens.shape[0], self.num_experts, self.topk, self.capacity_factor)
            probs, routing_map = drop_over_capacity(probs, routing_map, capacity, self.drop_policy,
                                                    self.pad_to_capacity)
        return probs, routing_map
