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

DeepSeek-V3's routing (Megatron-LM's flags):

* ``--moe-router-score-function sigmoid``: scores ``sigmoid(logits)``; the k chosen scores are divided by
  their sum (k > 1), so the weights sum to 1 as softmax's do;
* ``--moe-router-num-groups G --moe-router-group-topk g``: the E experts form G groups of consecutive experts;
  a token keeps the g groups whose two best scores sum highest and takes its top-k among their experts;
* ``--moe-router-topk-scaling-factor``: the k weights times this factor;
* ``--moe-router-enable-expert-bias``: auxiliary-loss-free balancing. ``expert_bias [E]`` (a buffer, not a
  parameter) is added to the scores to *choose* the experts; the weights stay the unbiased scores. The router
  counts the tokens it routes to each expert during training (``tokens_per_expert``); after each optimizer step
  ``expert_bias.py`` sums the counts over the ranks that saw other tokens and moves every bias by
  ``--moe-router-bias-update-rate`` towards the experts below the mean load.
* ``seq_aux_loss``: the load-balancing loss of each sequence of the micro batch, averaged over them.

With context parallelism each cp rank routes part of every sequence: the counts ``f`` of both losses are summed over
the cp group (no gradient), ``P`` stays this rank's mean, and the cp ranks' mean loss (what the dp x cp gradient
average and the log take) is the whole sequences' loss. Tensor parallelism needs nothing: the MoE layer routes the
gathered sequence on every tp rank.

The load-balancing losses score every expert without the bias or the group limit (Megatron-LM's and
DeepSeek-V3's rule): ``softmax(logits)``, or sigmoid scores divided by their sum over the E experts, and
their plain top-k as ``f``. Qwen3-MoE's normalized top-k (``norm_topk_prob``: softmax over all experts, top-k,
then divided by the k's sum) is the default softmax order: the same weights as a softmax over the k logits.

Capacity (``--moe-expert-capacity-factor c``): each expert takes at most ``ceil(c * T * k / E)`` of the
micro batch's assignments (at most T); the rest are dropped (the token gets nothing from that expert). Which
ones stay is ``--moe-token-drop-policy``: the highest probabilities, or the earliest tokens; ties go to the
earlier token (a stable sort), so dropping is deterministic. ``--moe-pad-expert-input-to-capacity`` fills
every expert up to exactly the capacity with tokens not routed to it, at weight 0 (Megatron-LM's trick).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from megatron_like import collectives as comm
from megatron_like.config import ModelConfig
from megatron_like.model.moe.aux_losses import attach_aux_loss, record_aux_loss
from megatron_like.tensor_parallel import init_generator, mark_replicated, new_parameter, normal_init, weight_grad
from megatron_like.tensor_parallel.initialization import draw_slice
from megatron_like.tensor_parallel.random import is_recomputing

TopK = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
"""``(scores [T, E], k) -> (values, indices) [T, k]``: plain or group-limited top-k."""


def plain_topk(scores: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.topk(scores, k=topk, dim=-1)


def topk_softmax(logits: torch.Tensor, topk: int, pre_softmax: bool,
                 select: TopK = plain_topk) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [T, E]`` -> weights and expert indices ``[T, k]`` (see the module docstring for the order)."""
    if pre_softmax:
        return select(torch.softmax(logits, dim=-1), topk)
    top_logits, indices = select(logits, topk)
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


def group_limited_topk(scores: torch.Tensor, topk: int, num_groups: int,
                       group_topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``scores [T, E]`` -> the top-k values and indices ``[T, k]`` among the experts of each token's best
    ``group_topk`` of ``num_groups`` groups (consecutive experts), a group scored by the sum of its two best
    scores (DeepSeek-V3; one score when a group holds one expert)."""
    tokens, experts = scores.shape
    per_group = experts // num_groups
    grouped = scores.view(tokens, num_groups, per_group)
    group_scores = grouped.topk(min(2, per_group), dim=-1).values.sum(dim=-1)  # [T, G]
    best_groups = group_scores.topk(group_topk, dim=-1).indices
    allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
    allowed = allowed.repeat_interleave(per_group, dim=1)  # [T, E]
    return scores.masked_fill(~allowed, float("-inf")).topk(topk, dim=-1)


def scores_for_aux_loss(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """``[T, E]`` scores of every expert that sum to 1 per token: softmax, or sigmoids divided by their sum."""
    if score_function == "softmax":
        return torch.softmax(logits, dim=-1)
    scores = torch.sigmoid(logits)
    return scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)


def fraction_routed_over_cp(chosen: torch.Tensor, tokens: int, topk: int, cp_group: comm.Group) -> torch.Tensor:
    """``f``: the share of the ``tokens x topk`` assignments that chose each expert, both summed over ``cp_group``.

    ``chosen [tokens, ..., E]`` bool marks this rank's choices (counted over dim 0); the result is ``[..., E]``, a
    count with no gradient. With context parallelism each cp rank holds part of every sequence: the counts and the
    token total become the whole sequence's.
    """
    routed = chosen.sum(dim=0).float()
    counts = torch.cat([routed.flatten(), routed.new_full((1,), float(tokens))])
    comm.all_reduce(counts, cp_group)
    return counts[:-1].view_as(routed) / (counts[-1] * topk)


def sequence_load_balancing_loss(scores: torch.Tensor, num_sequences: int, topk: int,
                                 cp_group: comm.Group = None) -> torch.Tensor:
    """The Switch loss of each sequence, averaged over the ``num_sequences`` of the micro batch.

    ``scores [T = s b, E]`` (rows sequence-position-major, as the MoE layer flattens ``[s, b, h]``; each row sums
    to 1); ``f`` counts each sequence's own top-k choices (DeepSeek-V2/V3's sequence-wise balance loss). With
    context parallelism (``cp_group``) ``f`` is each whole sequence's and ``P`` this rank's part of it, as in
    :func:`switch_load_balancing_loss`: the mean of the cp ranks' losses is the whole sequences' loss.
    """
    tokens, experts = scores.shape
    per_sequence = scores.view(tokens // num_sequences, num_sequences, experts)  # [s, b, E]
    chosen = torch.zeros_like(per_sequence, dtype=torch.bool).scatter_(
        2, per_sequence.topk(topk, dim=-1).indices, True)
    fraction_routed = fraction_routed_over_cp(chosen, per_sequence.shape[0], topk, cp_group)  # [b, E]
    mean_prob = per_sequence.mean(dim=0)  # [b, E]
    return experts * (fraction_routed * mean_prob).sum(dim=-1).mean()


def switch_load_balancing_loss(scores: torch.Tensor, routing_map: torch.Tensor, topk: int,
                               cp_group: comm.Group = None) -> torch.Tensor:
    """``E * sum_e f_e * P_e``: ``scores [T, E]`` softmax over all experts, ``routing_map [T, E]`` before dropping.

    With context parallelism (``cp_group``) the counts ``f_e`` are the whole sequence's (summed over cp) and ``P_e``
    this rank's: the loss is linear in ``P_e``, so the mean of the cp ranks' losses (the dp x cp gradient average
    and the logged mean) is the whole sequence's loss.
    """
    tokens, experts = scores.shape
    fraction_routed = fraction_routed_over_cp(routing_map, tokens, topk, cp_group)  # f_e, no gradient (a count)
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
    """Scores ``[T, h]`` tokens against E experts (weight ``[E, h]``, replicated over tp) and routes them.

    With ``--moe-router-enable-expert-bias`` it holds ``expert_bias [E]`` fp32 (persistent: checkpoints save it)
    and ``tokens_per_expert [E]`` (this step's counts on this rank, not saved; zero between steps).
    """

    def __init__(self, config: ModelConfig, layer: int, seed: int, dtype: torch.dtype,
                 device: torch.device, cp_group: comm.Group = None) -> None:
        super().__init__()
        self.layer, self.cp_group = layer, cp_group
        self.num_experts, self.topk = config.num_experts, config.moe_router_topk
        self.pre_softmax, self.score_function = config.moe_router_pre_softmax, config.moe_router_score_function
        self.num_groups, self.group_topk = config.moe_router_num_groups, config.moe_router_group_topk
        self.scaling_factor = config.moe_router_topk_scaling_factor
        self.balancing = config.moe_router_load_balancing_type
        self.aux_loss_coeff, self.z_loss_coeff = config.moe_aux_loss_coeff, config.moe_z_loss_coeff
        self.capacity_factor = config.moe_expert_capacity_factor
        self.drop_policy, self.pad_to_capacity = config.moe_token_drop_policy, config.moe_pad_expert_input_to_capacity
        self.bias_update_rate = config.moe_router_bias_update_rate
        if config.moe_router_enable_expert_bias:
            # fp32 whatever the model's dtype: bf16 cannot hold steps of 1e-3 on a bias grown past 0.25.
            self.register_buffer("expert_bias", torch.zeros(config.num_experts, dtype=torch.float32, device=device))
            self.register_buffer("tokens_per_expert", torch.zeros(config.num_experts, dtype=torch.float32,
                                                                  device=device), persistent=False)
        else:
            self.expert_bias = self.tokens_per_expert = None
        shape = (config.num_experts, config.hidden_size)

        def draw(out: torch.Tensor) -> None:
            generator = init_generator(seed, f"layers.{layer}.mlp.router.weight")
            draw_slice(out, normal_init(config.init_method_std), generator, shape)

        # Every tp rank routes the same (gathered) tokens, so its gradient is whole: not a sequence-parallel param.
        self.weight = mark_replicated(new_parameter(shape, dtype, device, draw), sequence_parallel=False)

    def _record(self, name: str, value: torch.Tensor) -> None:
        if not is_recomputing():  # a recomputed forward must not count its micro batch twice
            record_aux_loss(name, self.layer, value)

    def _topk(self, scores: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k values and indices ``[T, k]`` of ``scores [T, E]``, inside the token's best groups if grouped."""
        if self.group_topk:
            return group_limited_topk(scores, topk, self.num_groups, self.group_topk)
        return plain_topk(scores, topk)

    def choose(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``logits [T, E]`` -> weights and expert indices ``[T, k]`` (score function, groups, bias, scaling)."""
        if self.score_function == "softmax":
            weights, indices = topk_softmax(logits, self.topk, self.pre_softmax, self._topk)
        else:
            scores = torch.sigmoid(logits)
            if self.expert_bias is not None:  # the bias chooses; the weights stay the unbiased scores
                _, indices = self._topk(scores.detach() + self.expert_bias, self.topk)
                weights = scores.gather(1, indices)
            else:
                weights, indices = self._topk(scores, self.topk)
            if self.topk > 1:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        if self.scaling_factor is not None:
            weights = weights * self.scaling_factor
        return weights, indices

    def forward(self, tokens: torch.Tensor, num_sequences: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """``tokens [T, h]`` (``T = s * num_sequences``, position-major) -> ``probs [T, E]`` fp32 and
        ``routing_map [T, E]`` bool."""
        logits = weight_grad.linear(tokens.float(), self.weight.float(), None, "mkl")  # routing decisions in fp32
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
            weights, indices = self.choose(logits)
        probs = torch.zeros_like(logits).scatter(1, indices, weights)
        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, indices, True)
        if self.tokens_per_expert is not None and training and not is_recomputing():
            # The router's choices, before capacity drops any (padding to capacity would even them out).
            self.tokens_per_expert += routing_map.sum(dim=0)
        if self.balancing in ("aux_loss", "seq_aux_loss") and training:
            scores = scores_for_aux_loss(logits, self.score_function)
            if self.balancing == "aux_loss":
                loss_map = torch.zeros_like(routing_map).scatter_(1, scores.topk(self.topk, dim=-1).indices, True)
                loss = switch_load_balancing_loss(scores, loss_map, self.topk, self.cp_group)
            else:
                loss = sequence_load_balancing_loss(scores, num_sequences, self.topk, self.cp_group)
            self._record("load_balancing_loss", loss)
            if self.aux_loss_coeff > 0:
                probs = attach_aux_loss(probs, self.aux_loss_coeff * loss)
        if self.capacity_factor is not None:
            capacity = expert_capacity(tokens.shape[0], self.num_experts, self.topk, self.capacity_factor)
            probs, routing_map = drop_over_capacity(probs, routing_map, capacity, self.drop_policy,
                                                    self.pad_to_capacity)
        return probs, routing_map

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert: torch.Tensor) -> None:
        """Move ``expert_bias`` by the update rate towards the experts below the mean of ``tokens_per_expert [E]``
        (the step's counts summed over every rank that routed other tokens) and zero this rank's counter."""
        offset = tokens_per_expert.mean() - tokens_per_expert
        self.expert_bias += self.bias_update_rate * torch.sign(offset)
        self.tokens_per_expert.zero_()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        if self.expert_bias is not None and prefix + "expert_bias" not in state_dict:
            # A checkpoint trained without the bias (--finetune turning it on): start it at zero, report nothing.
            state_dict = {**state_dict, prefix + "expert_bias": torch.zeros_like(self.expert_bias)}
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
