"""Multi-latent attention (MLA, DeepSeek-V2/V3), chosen by ``--multi-latent-attention``.

Queries and keys/values pass through low-rank latents; RoPE acts on a separate slice of each head::

    q latent   c_q  = RMSNorm(x W_q_down)                    [s, b, q_lora_rank]   (or no latent: q = x W_q)
    queries    q    = c_q W_q_up  -> per head [q_nope | q_rope]   qk_head_dim + qk_pos_emb_head_dim
    kv latent  [c_kv | k_rope] = x W_kv_down                 [s, b, kv_lora_rank + qk_pos_emb_head_dim]
               c_kv = RMSNorm(c_kv)
    keys, values  c_kv W_kv_up -> per head [k_nope | v]     qk_head_dim + v_head_dim
    key of head i = [k_nope_i | rope(k_rope)]   (one rotated slice shared by every head)
    out = softmax(q k^T * scale) v -> W_proj

``scale = 1 / sqrt(qk_head_dim + qk_pos_emb_head_dim)``, times YaRN's ``m(mscale_all_dim)^2`` with
``--rope-type yarn`` (``model/rotary.py``).

Tensor parallelism (as Megatron-LM's MLA): the up-projections are column-parallel by heads and the output
projection row-parallel; the down-projections and the latents' norms are *duplicated*: every tp rank holds them
whole and applies them to its own input (the sequence shard under sequence parallelism). The latent then enters
the up-projections through their usual entry (all-gather of the sequence with sequence parallelism, else the
identity), whose backward sums the latent's gradient over the tp ranks' heads; the shared ``k_rope`` slice goes
through the same entry by hand. The down-projections' weight gradients are then whole without sequence
parallelism, and partial sums over sequence shards with it: those parameters are tagged ``sequence_parallel``
and all-reduced over tp like the norms (``tensor_parallel/layers.py``).

Context parallelism (``--context-parallel-size``, ``model/context_parallel/``): each cp rank holds two chunks of
the sequence; the rope slices rotate at the tokens' global positions (``cp_rotary_tables``) and the full per-head
keys ``[k_nope | rope(k_rope)]`` and values (narrower than the keys) go to ``context_parallel_attention``, whose
ring, all-gather and all-to-all modes and blockwise core take a value head dim of its own.

Generation (``cached_attention``) keeps only ``[c_kv | rope(k_rope)]`` per token in the cache
(``inference/kv_cache.py``'s latent mode) and decodes with ``W_kv_up`` absorbed into the query and the output.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from megatron_like.config import ModelConfig
from megatron_like.kernels import fused_apply_rotary
from megatron_like.model.blockwise_attention import blockwise_attention
from megatron_like.model.context_parallel import context_parallel_attention, cp_rotary_tables
from megatron_like.model.dropout import LAYOUT_INDEPENDENT, per_head_attention
from megatron_like.model.norms import RMSNorm
from megatron_like.model.rotary import rope_scaling_of, sequence_rotary_tables
from megatron_like.parallel_state import ParallelState
from megatron_like.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    get_rng_tracker,
    init_generator,
    mark_replicated,
    new_parameter,
    normal_init,
)
from megatron_like.tensor_parallel.initialization import draw_slice
from megatron_like.tensor_parallel.random import checkpoint


def reorder_rope_rows(weight: torch.Tensor, heads: int, rope_dim: int, to_ours: bool) -> torch.Tensor:
    """``weight [heads * d, in]`` with the last ``rope_dim`` rows of each head's ``d`` reordered: DeepSeek's
    interleaved pairs (HF's ``rope_interleave``, Megatron-core's MLA) to our halves (evens first, then odds;
    ``to_ours``) or back."""
    evens_then_odds = torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)]).to(weight.device)
    order = evens_then_odds if to_ours else torch.argsort(evens_then_odds)
    per_head = weight.reshape(heads, -1, weight.shape[-1]).clone()
    per_head[:, -rope_dim:] = per_head[:, -rope_dim:][:, order]
    return per_head.reshape(weight.shape)


class DuplicatedLinear(nn.Module):
    """``x W^T`` with ``W [out, in]`` held whole by every tp rank (drawn from its own generator by ``name``).

    Applied to whatever this rank holds (a sequence shard with sequence parallelism): with it the weight's
    gradient is a partial sum over shards, so the weight is tagged for the tp all-reduce.
    """

    def __init__(self, input_size: int, output_size: int, *, std: float, seed: int, name: str,
                 sequence_parallel: bool, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        shape = (output_size, input_size)

        def fill(out: torch.Tensor) -> None:
            draw_slice(out, normal_init(std), init_generator(seed, name + ".weight"), shape)

        self.weight = mark_replicated(new_parameter(shape, dtype, device, fill), sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class MultiLatentAttention(nn.Module):
    """MLA over this rank's ``heads / tp`` heads: ``[s, b, h]`` (``[s / tp, b, h]`` with sequence parallelism)
    -> same shape. See the module docstring for the formulas and the tensor-parallel layout."""

    def __init__(self, config: ModelConfig, ps: ParallelState, layer: int, seed: int,
                 sequence_parallel: bool, dtype: torch.dtype, causal: bool = True) -> None:
        super().__init__()
        h, heads = config.hidden_size, config.num_attention_heads
        self.layer, self.causal = layer, causal
        self.context_parallel = ps if ps.cp_size > 1 else None  # this rank holds two chunks of each sequence
        self.tp_group, self.sequence_parallel = ps.tp_group, sequence_parallel
        self.heads_per_rank = heads // ps.tp_size
        self.nope_dim, self.rope_dim, self.v_dim = config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.rotary_base = config.rotary_base
        self.rope_scaling = rope_scaling_of(config)
        factor = 1.0 if self.rope_scaling is None else self.rope_scaling.softmax_scale_factor
        self.softmax_scale = factor / math.sqrt(self.nope_dim + self.rope_dim)
        self.attention_dropout = config.attention_dropout
        # --dropout-rng layout-independent: each global head draws its own mask (model/dropout.py)
        self.per_head_dropout = config.dropout_rng == LAYOUT_INDEPENDENT
        self.total_heads, self.first_head = heads, ps.tp_rank * self.heads_per_rank
        self.recompute_core_attention = config.recompute_granularity == "selective"
        std = config.init_method_std
        name = f"layers.{layer}.attention"

        def column(input_size: int, output_size: int, part: str) -> ColumnParallelLinear:
            return ColumnParallelLinear(
                input_size, output_size, tp_group=ps.tp_group, init_method=normal_init(std), seed=seed,
                name=f"{name}.{part}", bias=False, sequence_parallel=sequence_parallel, dtype=dtype,
                device=ps.device, gemm_backend=config.cpu_gemm_backend)

        def duplicated(input_size: int, output_size: int, part: str) -> DuplicatedLinear:
            return DuplicatedLinear(input_size, output_size, std=std, seed=seed, name=f"{name}.{part}",
                                    sequence_parallel=sequence_parallel, dtype=dtype, device=ps.device)

        def latent_norm(rank: int) -> RMSNorm:
            norm = RMSNorm(rank, config.norm_epsilon, dtype, ps.device)
            mark_replicated(norm.weight, sequence_parallel)
            return norm

        q_size = heads * (self.nope_dim + self.rope_dim)
        self.q_lora = config.q_lora_rank is not None
        if self.q_lora:
            self.q_down = duplicated(h, config.q_lora_rank, "q_down")
            self.q_norm = latent_norm(config.q_lora_rank)
            self.q_up = column(config.q_lora_rank, q_size, "q_up")
        else:
            self.q_proj = column(h, q_size, "q_proj")
        self.kv_down = duplicated(h, self.kv_lora_rank + self.rope_dim, "kv_down")
        self.kv_norm = latent_norm(self.kv_lora_rank)
        self.kv_up = column(self.kv_lora_rank, heads * (self.nope_dim + self.v_dim), "kv_up")
        scaled_std = std / math.sqrt(2.0 * config.num_layers)  # GPT-2's, for projections into the residual stream
        self.proj = RowParallelLinear(
            heads * self.v_dim, h, tp_group=ps.tp_group, init_method=normal_init(scaled_std), seed=seed,
            name=f"{name}.proj", bias=False, sequence_parallel=sequence_parallel, dtype=dtype, device=ps.device,
            gemm_backend=config.cpu_gemm_backend)

    # ------------------------------------------------------------------ projections
    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """``[s (/ tp), b, h]`` -> this rank's queries ``[s, b, np * (nope + rope)]`` (whole sequence)."""
        if self.q_lora:
            return self.q_up(self.q_norm(self.q_down(x)))
        return self.q_proj(x)

    def latent(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[s (/ tp), b, h]`` -> the normalized kv latent ``[s (/ tp), b, kv_lora_rank]`` and the unrotated shared
        key slice ``[s, b, rope]`` of the whole sequence (gathered like the up-projections' input)."""
        c_kv, k_rope = self.kv_down(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        if self.sequence_parallel:
            # Every tp rank's heads read k_rope: the backward sums their gradients (reduce-scatter).
            k_rope = gather_from_sequence_parallel_region(k_rope, self.tp_group, grad_is_partial=True)
        else:
            k_rope = copy_to_tensor_parallel_region(k_rope, self.tp_group)
        return self.kv_norm(c_kv), k_rope

    def split_heads(self, q: torch.Tensor, kv: torch.Tensor, k_rope: torch.Tensor,
                    rotary_tables: tuple[torch.Tensor, torch.Tensor] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``[s, b, np (nope + rope)]``, kv ``[s, b, np (nope + v)]``, k_rope ``[s, b, rope]`` -> q, k
        ``[b, np, s, nope + rope]`` (rope slices rotated) and v ``[b, np, s, v]``.

        ``rotary_tables``: cos, sin ``[s, rope]`` of the tokens' positions; None = positions ``0 .. s - 1``, or with
        context parallelism the global positions of this cp rank's two chunks.
        """
        s, b, _ = q.shape
        np_ = self.heads_per_rank
        q = q.view(s, b, np_, self.nope_dim + self.rope_dim).permute(1, 2, 0, 3)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        k_nope, v = kv.view(s, b, np_, self.nope_dim + self.v_dim).permute(1, 2, 0, 3).split(
            [self.nope_dim, self.v_dim], dim=-1)
        q_rope, k_rope = self.rotate(q_rope, k_rope.permute(1, 0, 2).unsqueeze(1), rotary_tables)  # k: (b, 1, s, r)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(b, np_, s, self.rope_dim)], dim=-1)
        return q, k, v

    def rotate(self, q_rope: torch.Tensor, k_rope: torch.Tensor,
               rotary_tables: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE on the position slices ``[b, heads, s, rope]`` (keys: one head)."""
        if rotary_tables is None and self.context_parallel is not None:
            rotary_tables = cp_rotary_tables(q_rope.shape[2], self.rope_dim, self.rotary_base, self.rope_scaling,
                                             self.context_parallel, q_rope.device)
        elif rotary_tables is None:
            rotary_tables = sequence_rotary_tables(q_rope.shape[2], self.rope_dim, self.rotary_base, q_rope.device,
                                                   self.rope_scaling)
        cos, sin = rotary_tables
        return fused_apply_rotary(q_rope, cos, sin), fused_apply_rotary(k_rope, cos, sin)

    def merge_heads(self, context: torch.Tensor) -> torch.Tensor:
        """``[b, np, s, v]`` -> ``[s, b, np * v]``."""
        b, _, s, _ = context.shape
        return context.permute(2, 0, 1, 3).reshape(s, b, self.heads_per_rank * self.v_dim)

    # ------------------------------------------------------------------ training
    def core_attention(self, q: torch.Tensor, kv: torch.Tensor, k_rope: torch.Tensor,
                       document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """softmax(q k^T scale) v over the whole sequence: the ``split_heads`` inputs -> ``[s, b, np * v]``.

        ``document_ids`` int64 ``[b, s]`` (packed documents): attention stays within equal ids, through the blockwise
        core (it skips the pairs of other documents). With context parallelism the other cp ranks hold the rest of
        the sequence (``context_parallel_attention``, every ``--cp-comm-type``)."""
        q, k, v = self.split_heads(q, kv, k_rope)
        dropout_p = self.attention_dropout if self.training else 0.0

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if self.context_parallel is not None:
                return context_parallel_attention(q, k, v, self.context_parallel, causal=self.causal,
                                                  dropout_p=dropout_p, softmax_scale=self.softmax_scale,
                                                  document_ids=document_ids)
            if document_ids is not None:
                context, _ = blockwise_attention(q, k, v, q_documents=document_ids, k_documents=document_ids,
                                                 causal=self.causal, softmax_scale=self.softmax_scale,
                                                 dropout_p=dropout_p)
                return context
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=self.causal,
                                                  scale=self.softmax_scale)

        if dropout_p > 0 and self.per_head_dropout:  # --dropout-rng layout-independent (refused with cp > 1)
            context = per_head_attention(attend, q, k, v, f"layers.{self.layer}.attention", self.total_heads,
                                         self.first_head)
        else:
            with get_rng_tracker().fork() if dropout_p > 0 else nullcontext():  # heads are tp shards
                context = attend(q, k, v)
        return self.merge_heads(context)

    def forward(self, x: torch.Tensor, inference_context=None, document_ids: torch.Tensor | None = None
                ) -> torch.Tensor:
        """``[s, b, h]`` (or its sequence shard) -> same shape. ``inference_context``: KV cache (generation);
        ``document_ids`` int64 ``[b, s]``: packed documents (attention stays within each), None for one sequence."""
        if inference_context is not None:
            return self.proj(self.cached_attention(x, inference_context))
        q = self.queries(x)
        c_kv, k_rope = self.latent(x)
        kv = self.kv_up(c_kv)
        if self.recompute_core_attention and self.training and torch.is_grad_enabled():
            return self.proj(checkpoint(self.core_attention, q, kv, k_rope, document_ids))
        return self.proj(self.core_attention(q, kv, k_rope, document_ids))

    # ------------------------------------------------------------------ generation
    def cached_attention(self, x: torch.Tensor, inference_context) -> torch.Tensor:
        """Attention of new tokens ``[s, b, h]`` over cached ones -> ``[s, b, np * v]``.

        With ``inference_context.cache_latent`` (the default) the cache stores ``[c_kv | rope(k_rope)]``
        ``[b, t, kv_lora_rank + rope]`` per layer and attention runs in the latent space: ``q_nope W_uk`` (the
        key half of ``W_kv_up``, absorbed into the query) scores against ``c_kv``, the context ``probs c_kv`` is
        taken back to values by ``W_uv`` (a prefill of several tokens up-projects the entries instead). Otherwise
        full keys and values are cached (the reference path).
        """
        s = x.shape[0]
        tables = inference_context.rotary_tables(s, self.rope_dim, self.rotary_base, x.device, self.rope_scaling)
        q = self.queries(x)
        c_kv, k_rope = self.latent(x)
        if not inference_context.cache_latent:
            q, k, v = self.split_heads(q, self.kv_up(c_kv), k_rope, tables)
            k, v, mask = inference_context.update_kv(self.layer, k, v)
            context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.softmax_scale)
            return self.merge_heads(context)
        b, np_ = x.shape[1], self.heads_per_rank
        q = q.view(s, b, np_, self.nope_dim + self.rope_dim).permute(1, 2, 0, 3)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q_rope, k_rope = self.rotate(q_rope, k_rope.permute(1, 0, 2).unsqueeze(1), tables)
        w_uk, w_uv = self.kv_up.weight.view(np_, self.nope_dim + self.v_dim, self.kv_lora_rank).split(
            [self.nope_dim, self.v_dim], dim=1)  # (np, nope, r), (np, v, r)
        q_latent = torch.einsum("bhsd,hdr->bhsr", q_nope, w_uk)  # (b, np, s, r)
        new_entries = torch.cat([c_kv.transpose(0, 1), k_rope.squeeze(1)], dim=-1)  # (b, s, r + rope)
        entries, mask = inference_context.update_latent(self.layer, new_entries)  # (b, t, r + rope)
        t = entries.shape[1]
        if s > 1:  # prefill: many queries share each entry, so expanding the entries once costs less than absorbing
            return self.expanded_attention(torch.cat([q_nope, q_rope], dim=-1), entries, mask)
        # Every head reads the same entries: fold the heads into the query rows, so both products are plain
        # batched matmuls over the cache as stored (SDPA would widen it to np heads first).
        queries = torch.cat([q_latent, q_rope], dim=-1).reshape(b, np_ * s, -1)  # (b, np s, r + rope)
        scores = torch.bmm(queries, entries.transpose(1, 2)).view(b, np_, s, t) * self.softmax_scale
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(entries.dtype)
        context_latent = torch.bmm(probs.view(b, np_ * s, t), entries[..., :self.kv_lora_rank])  # (b, np s, r)
        context = torch.einsum("bhsr,hvr->bhsv", context_latent.view(b, np_, s, self.kv_lora_rank), w_uv)
        return self.merge_heads(context)

    def expanded_attention(self, q: torch.Tensor, entries: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Attention over latent cache entries ``[b, t, r + rope]`` up-projected to full keys and values:
        q ``[b, np, s, nope + rope]`` (rope slice rotated) -> ``[s, b, np * v]``."""
        b, t, _ = entries.shape
        c_kv, k_rope = entries.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = F.linear(c_kv, self.kv_up.weight).view(b, t, self.heads_per_rank, self.nope_dim + self.v_dim)
        k_nope, v = kv.permute(0, 2, 1, 3).split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.unsqueeze(1).expand(b, self.heads_per_rank, t, self.rope_dim)], dim=-1)
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.softmax_scale)
        return self.merge_heads(context)
