"""The transformer layer: pre-norm, causal self-attention, MLP, residuals.

GPT-2/3 by default (LayerNorm, learned positions added in the embedding, GELU, biases); the Llama family
with ``--normalization RMSNorm --position-embedding-type rope --swiglu --group-query-attention
--disable-bias-linear`` (see docs/models.md). Each choice lives in one small function or module
(``build_norm``, ``apply_rotary``, ``swiglu``), so the forward passes below read the same either way.

Activations are ``[s, b, h]`` (sequence first, as in Megatron): with sequence parallelism the
LayerNorm/dropout regions hold ``[s / tp, b, h]`` and the tensor-parallel linears gather/scatter at
their boundaries. Inside attention and the MLP each rank holds ``heads / tp`` heads and ``ffn / tp``
features. Read this file top to bottom like a single-file model.

Activation recomputation (``--recompute-granularity``) lives here too: ``selective`` re-runs only the
attention core (its ``[b, np, s, s]`` scores dominate activation memory and cost few FLOPs);
``full`` re-runs whole layers (:func:`forward_layers`). Both go through the recompute-safe
``checkpoint``, so dropout masks are the same on the re-run.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from megatron_like.config import ModelConfig
from megatron_like.kernels import (
    bias_gelu,
    fused_apply_rotary,
    fused_swiglu,
    scaled_masked_softmax,
    scaled_upper_triang_masked_softmax,
)
from megatron_like.kernels.swiglu import swiglu_reference as swiglu  # noqa: F401 (the contract fused_swiglu meets)
from megatron_like.model.attention_mask import sliding_window_mask
from megatron_like.model.blockwise_attention import allowed_pairs, blockwise_attention
from megatron_like.model.context_parallel import context_parallel_attention, cp_rotary_tables
from megatron_like.model.dropout import LAYOUT_INDEPENDENT, ActivationDropout, per_head_attention
from megatron_like.model.norms import build_head_norm, build_norm
from megatron_like.model.rotary import rope_scaling_of, sequence_rotary_tables
from megatron_like.parallel_state import ParallelState
from megatron_like.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    get_rng_tracker,
    normal_init,
    scatter_to_sequence_parallel_region,
    xavier_uniform_init,
)
from megatron_like.tensor_parallel.initialization import InitMethod
from megatron_like.tensor_parallel.random import checkpoint


def embeddings_to_layers(x: torch.Tensor, tp_group, sequence_parallel: bool, dropout: ActivationDropout,
                         training: bool) -> torch.Tensor:
    """Embedding output ``[b, s, h]`` -> the layers' input ``[s, b, h]`` (``[s / tp, b, h]`` with sequence
    parallelism), with the embedding dropout drawn from the right stream for that layout."""
    x = x.transpose(0, 1).contiguous()  # (s, b, h)
    if sequence_parallel:
        x = scatter_to_sequence_parallel_region(x, tp_group)  # (s / tp, b, h)
    return dropout(x, training)


def layer_init_methods(config: ModelConfig) -> tuple[InitMethod, InitMethod]:
    """(init of the layer's input-side matrices, init of the two output projections that write into the residual
    stream): GPT-2's N(0, std^2) and N(0, (std / sqrt(2 L))^2), or Xavier uniform for both
    (``--init-method-xavier-uniform``, as Megatron-LM's flag)."""
    if config.init_method_xavier_uniform:
        return xavier_uniform_init(), xavier_uniform_init()
    return normal_init(config.init_method_std), normal_init(config.init_method_std / math.sqrt(2.0 * config.num_layers))


class SelfAttention(nn.Module):
    """Self-attention over this rank's ``heads / tp`` query heads and ``groups / tp`` key/value heads.

    Causal (GPT) or bidirectional (ViT); causal attention may be limited to a sliding window of the last
    ``--window-size`` keys (Mistral) and to the query's own document (packed sequences, ``--reset-attention-mask``:
    ``document_ids [b, s]``). Those two go through the blockwise core (``model/blockwise_attention.py``), which
    skips the key blocks no query may see; plain causal attention stays on SDPA. With grouped-query attention
    ``heads / groups`` query heads share one key/value head (multi-head attention: groups = heads). The fused QKV
    weight is laid out group by group (Megatron-LM's layout): output features ``[groups, heads / groups + 2,
    head_dim]``, each group's query heads then its key and its value. A contiguous tp slice so holds whole groups
    with their queries.
    Heads have ``--kv-channels`` features (default hidden / heads); ``--qk-layernorm`` (Qwen3) normalizes each
    query and key head over them before RoPE, with one weight for all query heads and one for all key heads
    (replicated over tp; their gradient is all-reduced over tp: ``norms.build_head_norm``).
    """

    def __init__(self, config: ModelConfig, ps: ParallelState, layer: int, seed: int,
                 sequence_parallel: bool, dtype: torch.dtype, causal: bool = True) -> None:
        super().__init__()
        h = config.hidden_size
        self.causal = causal
        self.heads_per_rank = config.num_attention_heads // ps.tp_size
        self.groups_per_rank = config.query_groups // ps.tp_size
        self.head_dim = config.head_dim
        self.rotary = config.position_embedding_type == "rope"
        self.rotary_dim, self.rotary_base = int(config.head_dim * config.rotary_percent), config.rotary_base
        self.rope_scaling = rope_scaling_of(config) if self.rotary else None
        self.window = config.attention_window if causal else None  # keys per query, itself included
        self.attention_dropout = config.attention_dropout
        # --dropout-rng layout-independent: each global head draws its own mask (model/dropout.py)
        self.per_head_dropout = config.dropout_rng == LAYOUT_INDEPENDENT
        self.total_heads, self.first_head = config.num_attention_heads, ps.tp_rank * self.heads_per_rank
        self.backend, self.softmax_fusion = config.attention_core, config.masked_softmax_fusion
        self.recompute_core_attention = config.recompute_granularity == "selective"
        self.layer = layer
        # Context parallelism: this rank holds two chunks of each sequence (model/context_parallel/)
        self.context_parallel = ps if ps.cp_size > 1 else None
        qkv_size = (config.num_attention_heads + 2 * config.query_groups) * self.head_dim
        init_method, output_init_method = layer_init_methods(config)
        self.qkv = ColumnParallelLinear(
            h, qkv_size, tp_group=ps.tp_group, init_method=init_method, seed=seed,
            name=f"layers.{layer}.attention.qkv", bias=config.qkv_bias, sequence_parallel=sequence_parallel,
            dtype=dtype, device=ps.device, gemm_backend=config.cpu_gemm_backend,
        )
        self.proj = RowParallelLinear(
            config.attention_size, h, tp_group=ps.tp_group, init_method=output_init_method, seed=seed,
            name=f"layers.{layer}.attention.proj", bias=config.linear_bias, sequence_parallel=sequence_parallel,
            dtype=dtype, device=ps.device, gemm_backend=config.cpu_gemm_backend,
        )
        # --qk-layernorm: one norm over head_dim for all query heads, one for all key heads (Qwen3).
        self.q_layernorm = build_head_norm(config, ps.tp_size, dtype, ps.device) if config.qk_layernorm else None
        self.k_layernorm = build_head_norm(config, ps.tp_size, dtype, ps.device) if config.qk_layernorm else None

    def split_qkv(self, qkv: torch.Tensor, rotary_tables: tuple[torch.Tensor, torch.Tensor] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[s, b, (np + 2 ng) hd]`` -> q ``[b, np, s, hd]``, k and v ``[b, ng, s, hd]``, each q and k head
        normalized (``--qk-layernorm``) and then rotated.

        ``rotary_tables``: cos and sin ``[s, rotary_dim]`` of the tokens' positions (generation: they
        continue after the cached tokens, see ``KVCache.rotary_tables``); None = positions ``0 .. s - 1``:
        training sees whole sequences (the QKV linear gathered the sequence-parallel shards), so those are
        the positions on every tp rank and pipeline stage (their tables are built once and cached); with
        context parallelism the global positions of this cp rank's two chunks.
        """
        s, b, _ = qkv.shape
        ng = self.groups_per_rank
        per_group = self.heads_per_rank // ng
        qkv = qkv.view(s, b, ng, per_group + 2, self.head_dim)
        q, k, v = qkv.split([per_group, 1, 1], dim=3)
        q, k = q.reshape(s, b, self.heads_per_rank, self.head_dim), k.squeeze(3)  # (s, b, np | ng, hd)
        if self.q_layernorm is not None:  # per head, before RoPE (which the norm's weight does not commute with)
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        q, k, v = q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.squeeze(3).permute(1, 2, 0, 3)
        if self.rotary:
            if rotary_tables is None and self.context_parallel is not None:
                rotary_tables = self.context_parallel_rotary_tables(s, qkv.device)
            elif rotary_tables is None:
                rotary_tables = sequence_rotary_tables(s, self.rotary_dim, self.rotary_base, qkv.device,
                                                       self.rope_scaling)
            cos, sin = rotary_tables
            q, k = fused_apply_rotary(q, cos, sin), fused_apply_rotary(k, cos, sin)
        return q, k, v

    def context_parallel_rotary_tables(self, s: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[s, rotary_dim]`` at the global positions of this cp rank's ``s`` tokens."""
        return cp_rotary_tables(s, self.rotary_dim, self.rotary_base, self.rope_scaling, self.context_parallel,
                                device)

    def merge_heads(self, context: torch.Tensor) -> torch.Tensor:
        """``[b, np, s, hd]`` -> ``[s, b, np * hd]``."""
        b, _, s, _ = context.shape
        return context.permute(2, 0, 1, 3).reshape(s, b, self.heads_per_rank * self.head_dim)

    def window_mask(self, s: int, device: torch.device) -> torch.Tensor | None:
        """bool ``[s, s]`` (True = attend) when the sliding window is shorter than the sequence; None when
        plain causal (or bidirectional) attention is the same thing."""
        if self.window is None:
            return None
        # Under torch.compile / torch.export ``s`` may be symbolic: a branch on it would pin the sequence length
        # (export's dynamic ``seq`` then fails), and the band is exact at any length.
        if not torch.compiler.is_compiling() and self.window >= s:
            return None
        return sliding_window_mask(s, self.window, device)

    def skips_masked_blocks(self, s: int, document_ids: torch.Tensor | None) -> bool:
        """Whether the blockwise core serves this call: a window shorter than the sequence or packed documents,
        outside torch.compile / torch.export (the core plans its tiles in Python from the actual positions)."""
        if torch.compiler.is_compiling():
            return False
        return document_ids is not None or (self.window is not None and self.window < s)

    def dense_mask(self, s: int, device: torch.device, document_ids: torch.Tensor | None) -> torch.Tensor | None:
        """bool ``[s, s]`` or ``[b, 1, s, s]`` (True = attend) for the dense cores, None when plain causal or
        bidirectional attention is the same thing: the window's band, and with documents the pairs of one
        document (only under compilation; else the blockwise core takes them)."""
        if document_ids is None:
            return self.window_mask(s, device)
        positions = torch.arange(s, device=device)
        window_left = None if self.window is None else self.window - 1
        return allowed_pairs(positions, positions, document_ids, document_ids, window_left, self.causal)[:, None]

    def core_attention(self, qkv: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """softmax(q k^T / sqrt(d)) v, causal or not: ``[s, b, (np + 2 ng) hd]`` -> ``[s, b, np * hd]``.

        Sequence parallelism gathered the whole sequence in the QKV linear, so the masking (causal, the sliding
        window, ``document_ids [b, s]``) is that of the full sequence on every tp rank; heads are what tp splits.
        """
        q, k, v = self.split_qkv(qkv)
        dropout_p = self.attention_dropout if self.training else 0.0
        blockwise = self.skips_masked_blocks(q.shape[2], document_ids)
        band = None if blockwise or self.context_parallel is not None else self.dense_mask(q.shape[2], q.device,
                                                                                          document_ids)
        window_left = None if self.window is None else self.window - 1

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if self.context_parallel is not None:  # the other cp ranks hold the rest of the sequence
                return context_parallel_attention(q, k, v, self.context_parallel, window_left=window_left,
                                                  causal=self.causal, dropout_p=dropout_p, document_ids=document_ids)
            if blockwise:
                return blockwise_attention(q, k, v, q_documents=document_ids, k_documents=document_ids,
                                           window_left=window_left, causal=self.causal, dropout_p=dropout_p)[0]
            if self.backend == "sdpa":
                return F.scaled_dot_product_attention(
                    q, k, v, attn_mask=band, dropout_p=dropout_p, is_causal=self.causal and band is None,
                    enable_gqa=q.shape[1] != k.shape[1],
                )
            return self.local_attention(q, k, v, dropout_p, band)

        if dropout_p > 0 and self.per_head_dropout:
            context = per_head_attention(attend, q, k, v, f"layers.{self.layer}.attention", self.total_heads,
                                         self.first_head)
        else:
            # Heads are tp shards, so Megatron's dropout draws their masks from the per-tp-rank stream.
            with get_rng_tracker().fork() if dropout_p > 0 else nullcontext():
                context = attend(q, k, v)
        return self.merge_heads(context)

    def local_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
                        band: torch.Tensor | None = None) -> torch.Tensor:
        """The attention core written out: q ``[b, np, s, hd]``, k, v ``[b, ng, s, hd]`` -> ``[b, np, s, hd]``;
        ``band``: bool ``[s, s]`` or ``[b, 1, s, s]`` (True = attend, see ``dense_mask``), None for plain causal or
        bidirectional."""
        repeat = q.shape[1] // k.shape[1]
        if repeat > 1:  # each key/value head serves the `repeat` consecutive query heads of its group
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        scale = 1.0 / math.sqrt(self.head_dim)
        scores = torch.matmul(q, k.transpose(-1, -2))  # (b, np, s, s)
        if band is not None and self.softmax_fusion:
            probs = scaled_masked_softmax(scores, ~band, scale)  # the kernel's mask is True = masked out
        elif band is not None:
            probs = torch.softmax(scores.masked_fill(~band, float("-inf")) * scale, dim=-1)
        elif self.softmax_fusion and self.causal:
            probs = scaled_upper_triang_masked_softmax(scores, scale)
        elif self.softmax_fusion:
            probs = scaled_masked_softmax(scores, None, scale)
        else:
            if self.causal:
                s = scores.shape[-1]
                future = torch.ones(s, s, dtype=torch.bool, device=scores.device).triu_(1)
                scores = scores.masked_fill(future, float("-inf"))
            probs = torch.softmax(scores * scale, dim=-1)
        return torch.matmul(F.dropout(probs, p=dropout_p, training=dropout_p > 0), v)

    def cached_attention(self, qkv: torch.Tensor, inference_context) -> torch.Tensor:
        """Attention of new tokens over cached ones (generation): ``[s, b, (np + 2 ng) hd]`` -> ``[s, b, np * hd]``.

        ``inference_context.update_kv(layer, k, v)`` appends this step's keys and values ``[b, ng, s, hd]``
        (one per query group: the cache is sized by groups) to its cache and returns every cached key and
        value ``[b, ng, t, hd]`` with the attention mask (bool ``[b, 1, s, t]``, True = attend; None = attend
        to all) that encodes causality, the sliding window (over cached keys too) and padding. Rotary positions
        continue after the cached tokens; their tables are built once per generation by the cache and sliced per
        step.
        """
        tables = None
        if self.rotary:
            tables = inference_context.rotary_tables(qkv.shape[0], self.rotary_dim, self.rotary_base, qkv.device,
                                                     self.rope_scaling)
        q, k, v = self.split_qkv(qkv, tables)
        k, v, mask = inference_context.update_kv(self.layer, k, v, self.window)  # (b, ng, t, hd)
        context = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=self.groups_per_rank != self.heads_per_rank
        )  # (b, np, s, hd)
        return self.merge_heads(context)

    def forward(self, x: torch.Tensor, inference_context=None, document_ids: torch.Tensor | None = None
                ) -> torch.Tensor:
        """``[s, b, h]`` (or its sequence shard) -> same shape. ``inference_context``: KV cache (generation);
        ``document_ids``: int64 ``[b, s]`` of packed documents, attention stays within equal ids (None: one
        sequence)."""
        if inference_context is not None:
            return self.proj(self.cached_attention(self.qkv(x), inference_context))
        qkv = self.qkv(x)
        if self.recompute_core_attention and self.training and torch.is_grad_enabled():
            return self.proj(checkpoint(self.core_attention, qkv, document_ids))
        return self.proj(self.core_attention(qkv, document_ids))


class MLP(nn.Module):
    """h -> ffn / tp -> h: GELU (tanh approximation, as GPT-2) or SwiGLU.

    With ``--swiglu`` the first linear computes gate and up together: its ``2 ffn`` output features are
    (gate, up) pairs (see ``swiglu``), so a contiguous tp slice of the weight holds the gate and up rows of
    the same ``ffn / tp`` features.
    """

    def __init__(self, config: ModelConfig, ps: ParallelState, layer: int, seed: int,
                 sequence_parallel: bool, dtype: torch.dtype, name: str | None = None) -> None:
        super().__init__()
        name = name or f"layers.{layer}.mlp"  # names the weights' generators (MoE: the shared expert's)
        h, ffn = config.hidden_size, config.ffn_size
        self.swiglu = config.swiglu
        self.bias_gelu_fusion = config.bias_gelu_fusion and config.linear_bias and not config.swiglu
        init_method, output_init_method = layer_init_methods(config)
        self.fc1 = ColumnParallelLinear(
            h, 2 * ffn if self.swiglu else ffn, tp_group=ps.tp_group, init_method=init_method,
            seed=seed, name=f"{name}.fc1", bias=config.linear_bias, sequence_parallel=sequence_parallel,
            dtype=dtype, device=ps.device, skip_bias_add=self.bias_gelu_fusion, gemm_backend=config.cpu_gemm_backend,
        )
        self.fc2 = RowParallelLinear(
            ffn, h, tp_group=ps.tp_group, init_method=output_init_method, seed=seed,
            name=f"{name}.fc2", bias=config.linear_bias, sequence_parallel=sequence_parallel,
            dtype=dtype, device=ps.device, gemm_backend=config.cpu_gemm_backend,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.fc2(fused_swiglu(self.fc1(x)))
        if self.bias_gelu_fusion:  # fc1 left its bias out: one pass adds it and applies GELU
            return self.fc2(bias_gelu(self.fc1(x), self.fc1.bias))
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class TransformerLayer(nn.Module):
    """x + dropout(attn(ln1(x))), then x + dropout(mlp(ln2(x))). ``layer`` is the global layer index;
    ln1 and ln2 are the model's --normalization.

    ``causal=False`` gives bidirectional attention (ViT); the weights are the same either way.
    """

    def __init__(self, config: ModelConfig, ps: ParallelState, layer: int, seed: int,
                 sequence_parallel: bool, dtype: torch.dtype, causal: bool = True) -> None:
        super().__init__()
        self.layer = layer
        self.sequence_parallel = sequence_parallel
        self.residual_dropout = ActivationDropout(config, ps, sequence_parallel, f"layers.{layer}.hidden")
        self.ln1 = build_norm(config, sequence_parallel, dtype, ps.device)
        if config.multi_latent_attention:
            from megatron_like.model.multi_latent_attention import MultiLatentAttention  # it imports this module's kin

            self.attention = MultiLatentAttention(config, ps, layer, seed, sequence_parallel, dtype, causal)
        else:
            self.attention = SelfAttention(config, ps, layer, seed, sequence_parallel, dtype, causal)
        self.ln2 = build_norm(config, sequence_parallel, dtype, ps.device)
        if config.is_moe_layer(layer):
            from megatron_like.model.moe import MoELayer  # the MoE package imports MLP from here

            self.mlp = MoELayer(config, ps, layer, seed, sequence_parallel, dtype)
        else:
            self.mlp = MLP(config, ps, layer, seed, sequence_parallel, dtype)

    def dropout(self, x: torch.Tensor) -> torch.Tensor:
        return self.residual_dropout(x, self.training)

    def forward(self, x: torch.Tensor, inference_context=None, document_ids: torch.Tensor | None = None
                ) -> torch.Tensor:
        """``[s, b, h]`` (``[s / tp, b, h]`` with sequence parallelism) -> same shape.

        ``inference_context`` (generation only): the KV cache passed to attention, see SelfAttention;
        ``document_ids`` int64 ``[b, s]``: packed documents (attention stays within each), None for one sequence.
        """
        if inference_context is not None:
            x = x + self.attention(self.ln1(x), inference_context)
            return x + self.mlp(self.ln2(x))
        x = x + self.dropout(self.attention(self.ln1(x), document_ids=document_ids))
        return x + self.dropout(self.mlp(self.ln2(x)))


def forward_layers(layers: nn.ModuleList, hidden_states: torch.Tensor, config: ModelConfig,
                   document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Run ``layers`` in order on ``[s, b, h]``, with full recomputation when configured and training.

    ``document_ids`` int64 ``[b, s]`` (packed documents, None for one sequence) reach every layer's attention.

    ``uniform`` checkpoints consecutive groups of ``--recompute-num-layers`` layers (only each group's
    input is kept); ``block`` checkpoints the first ``--recompute-num-layers`` layers of this chunk one
    by one and runs the rest normally (later pipeline stages hold fewer micro batches in flight).
    """
    recompute = (
        config.recompute_granularity == "full" and len(layers) > 0 and layers[0].training
        and torch.is_grad_enabled()
    )
    if not recompute:
        for layer in layers:
            hidden_states = layer(hidden_states, document_ids=document_ids)
        return hidden_states
    n = config.recompute_num_layers
    if config.recompute_method == "uniform":
        for start in range(0, len(layers), n):
            group = layers[start : start + n]

            def run_group(x: torch.Tensor, documents: torch.Tensor | None, group: nn.ModuleList = group
                          ) -> torch.Tensor:
                for layer in group:
                    x = layer(x, document_ids=documents)
                return x

            hidden_states = checkpoint(run_group, hidden_states, document_ids)
        return hidden_states
    for index, layer in enumerate(layers):
        if index < n:
            hidden_states = checkpoint(layer, hidden_states, None, document_ids)
        else:
            hidden_states = layer(hidden_states, document_ids=document_ids)
    return hidden_states
