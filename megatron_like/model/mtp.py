"""Multi-token prediction (DeepSeek-V3 §2.2; Megatron-LM's ``--mtp-num-layers``, ``--mtp-loss-scaling-factor``).

Beside the next token, the last pipeline stage predicts tokens further ahead with ``D`` sequential depths. Depth
``k`` (1..D) at position ``t``:

    h^k(t) = final_norm_k(layer_k(eh_proj_k([enorm_k(emb(token t+k)); hnorm_k(h^(k-1)(t))])))

and predicts token ``t+k+1`` (= ``labels[t+k]``) through the model's own output layer; ``h^0`` is the main model's
final hidden state (after its final norm, the tensor the output layer sees, as in Megatron-LM). ``emb`` is the
model's word embedding (the same parameter, or the last stage's tied copy of it: ``gpt.py``); learned position
embeddings are not added (the depth's input already carries the position through ``h^(k-1)``). The embedding comes
first in the concatenation, as in Megatron-LM and DeepSeek-V3's released weights. Each depth's transformer layer is
an ordinary ``TransformerLayer`` with global index ``num_layers + k - 1`` (its weights' generator names), of the main
model's last layer's kind (``ModelConfig.is_moe_layer``): an MoE layer in an MoE model whose last layer is MoE, as
DeepSeek-V3's and Megatron-LM's (the same router, expert bias, experts and shared expert as any MoE layer).

Loss (:func:`mtp_loss`): depth ``k``'s per-token loss at ``t`` is masked by ``loss_mask[t+k]`` (the mask of the
token it predicts; the last ``k`` positions have no target in the sample and are masked out) and averaged over
those tokens, per micro batch, exactly as the LM loss is averaged over its mask; micro batches and data-parallel
ranks are then averaged the same way as the LM loss (Megatron-LM #1532 was MTP averaged differently). The training
loss is ``lm + factor / D * sum_k mtp_k``; the log shows each ``mtp_k loss`` beside the ``lm loss``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from megatron_like.config import ModelConfig
from megatron_like.model.context_parallel import gather_sequence, sequence_mean_loss, split_for_context_parallel
from megatron_like.model.norms import build_norm
from megatron_like.model.transformer import TransformerLayer, forward_layers
from megatron_like.parallel_state import ParallelState
from megatron_like.tensor_parallel import ColumnParallelLinear, normal_init, scatter_to_sequence_parallel_region


def shift_left(x: torch.Tensor, k: int, fill: int = 0) -> torch.Tensor:
    """``x [b, s]`` moved ``k`` positions left along the sequence: ``out[:, t] = x[:, t + k]``, the last ``k``
    positions ``fill``."""
    if k == 0:
        return x
    return torch.cat([x[:, k:], x.new_full((x.shape[0], min(k, x.shape[1])), fill)], dim=1)


def shifted_along_sequence(x: torch.Tensor, depths: int, ps: ParallelState | None) -> list[torch.Tensor]:
    """``x`` shifted left by 1 .. ``depths`` positions along the whole sequence (:func:`shift_left`), each ``[b,
    s_local]``. Under context parallelism ``x [b, s / cp]`` is this rank's two chunks and token ``t + k`` may lie in
    another rank's chunk: the ranks' chunks are gathered once, shifted and cut again (token ids and masks only)."""
    if ps is None or ps.cp_size == 1:
        return [shift_left(x, k) for k in range(1, depths + 1)]
    whole = gather_sequence(x, ps)
    return [split_for_context_parallel(shift_left(whole, k), ps.cp_size, ps.cp_rank) for k in range(1, depths + 1)]


class MTPDepth(nn.Module):
    """One prediction depth: embedding and previous hidden state, each normed, concatenated, projected ``2h -> h``,
    one transformer layer, a final norm. ``depth`` counts from 0 (it predicts ``depth + 2`` tokens ahead)."""

    def __init__(self, config: ModelConfig, ps: ParallelState, depth: int, seed: int, sequence_parallel: bool,
                 dtype: torch.dtype) -> None:
        super().__init__()
        h = config.hidden_size
        self.config, self.tp_group, self.sequence_parallel = config, ps.tp_group, sequence_parallel
        self.enorm = build_norm(config, sequence_parallel, dtype, ps.device)
        self.hnorm = build_norm(config, sequence_parallel, dtype, ps.device)
        # Column-parallel like Megatron-LM's (its weight splits by output features), gathered after: the layer
        # that follows takes whole hidden states (or their sequence shard).
        self.eh_proj = ColumnParallelLinear(
            2 * h, h, tp_group=ps.tp_group, init_method=normal_init(config.init_method_std), seed=seed,
            name=f"mtp.layers.{depth}.eh_proj", bias=False, gather_output=True, sequence_parallel=sequence_parallel,
            dtype=dtype, device=ps.device, gemm_backend=config.cpu_gemm_backend,
        )
        self.transformer_layer = nn.ModuleList(
            [TransformerLayer(config, ps, config.num_layers + depth, seed, sequence_parallel, dtype)]
        )
        self.final_layernorm = build_norm(config, sequence_parallel, dtype, ps.device)

    def forward(self, hidden_states: torch.Tensor, embedded: torch.Tensor,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Previous depth's ``[s, b, h]`` and the shifted tokens' embeddings ``[s, b, h]`` (both ``[s / tp, b, h]``
        with sequence parallelism) -> this depth's normed hidden states, same shape."""
        x = torch.cat([self.enorm(embedded), self.hnorm(hidden_states)], dim=-1)  # (s, b, 2h)
        x = self.eh_proj(x)  # (s, b, h): the whole sequence even with sequence parallelism (its input was gathered)
        if self.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x, self.tp_group)  # (s / tp, b, h)
        x = forward_layers(self.transformer_layer, x, self.config, document_ids)  # recompute-aware
        return self.final_layernorm(x)


class MultiTokenPrediction(nn.Module):
    """The ``--mtp-num-layers`` depths of the last pipeline stage (module docstring)."""

    def __init__(self, config: ModelConfig, ps: ParallelState, seed: int, sequence_parallel: bool,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.ps = ps
        self.layers = nn.ModuleList(
            MTPDepth(config, ps, depth, seed, sequence_parallel, dtype) for depth in range(config.mtp_num_layers)
        )

    def forward(self, hidden_states: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor,
                embed: Callable[[torch.Tensor], torch.Tensor],
                per_token_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                document_ids: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Each depth's per-token loss ``[b, s]`` (float32; unmasked: :func:`mtp_loss` masks it).

        Args:
            hidden_states: the main model's final (normed) hidden states ``[s, b, h]`` (``[s / tp, b, h]`` under
                sequence parallelism).
            input_ids, labels: ``[b, s]`` the micro batch's tokens and next tokens (``[b, s / cp]``, this cp rank's
                chunks, under context parallelism).
            embed: token ids ``[b, s]`` -> the model's word embeddings in the layers' layout ``[s, b, h]``.
            per_token_loss: hidden states and target ids ``[b, s]`` -> the output layer's cross entropy ``[b, s]``.
        """
        depths = len(self.layers)
        ahead = zip(shifted_along_sequence(input_ids, depths, self.ps), shifted_along_sequence(labels, depths, self.ps))
        losses = []
        for depth, (token_ids, targets) in zip(self.layers, ahead):
            hidden_states = depth(hidden_states, embed(token_ids), document_ids)
            losses.append(per_token_loss(hidden_states, targets))
        return losses


def mtp_loss(loss_mask: torch.Tensor, per_token_losses: torch.Tensor, scaling_factor: float,
             ps: ParallelState | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The micro batch's training loss and its logged statistics, with multi-token prediction.

    Args:
        loss_mask: ``[b, s]`` 1 where ``labels`` counts (the LM loss's mask).
        per_token_losses: ``[1 + D, b, s]``: the LM loss, then depth k's (``GPTModel(..., with_mtp=True)``).
        scaling_factor: ``--mtp-loss-scaling-factor``.
        ps: with context parallelism (``[b, s / cp]`` tensors, this rank's chunks) each mean is over the whole
            sequence (``sequence_mean_loss``); None or cp 1: over these tokens.
    Returns:
        ``lm + scaling_factor / D * sum_k mtp_k`` and ``{"lm loss": lm, "mtp_1 loss": mtp_1, ...}``.
    """
    def masked_mean(per_token: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the mean to backpropagate, the mean to report); a mask with no token gives 0."""
        if ps is not None and ps.cp_size > 1:
            return sequence_mean_loss(per_token, mask, ps)
        value = (per_token.float() * mask).sum() / mask.sum().clamp(min=1.0)
        return value, value.detach()

    mask = loss_mask.float()
    total, lm = masked_mean(per_token_losses[0], mask)
    stats = {"lm loss": lm}
    depths = per_token_losses.shape[0] - 1
    depth_masks = shifted_along_sequence(mask, depths, ps)  # depth k predicts token t+k+1 at t
    for k, depth_mask in enumerate(depth_masks, start=1):
        value, reported = masked_mean(per_token_losses[k], depth_mask)
        stats[f"mtp_{k} loss"] = reported
        total = total + scaling_factor / depths * value
    return total, stats
