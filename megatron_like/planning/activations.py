"""Activation memory of GPT training, per pipeline rank: what backward needs kept from forward.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", §4) count,
per transformer layer and micro batch of ``s`` tokens, ``b`` samples, hidden ``h``, ``a`` heads, with
2-byte activations and 1-byte dropout masks: ``s b h (34 + 5 a s / h)`` bytes. We keep their terms
apart so the element size ``e`` (2 for bf16/fp16, 4 for fp32) and each kind of parallelism apply to the
right ones (units of ``s b h`` unless said)::

    kept whole on each tp rank (split by tp only with sequence parallelism):
        LayerNorm inputs 2e, QKV input e, MLP input e, two dropout masks 2       -> 4e + 2
    (a column-parallel linear keeps its input's sequence shard and gathers it again in backward, and under a
    zero-bubble schedule in W; with --keep-gathered-sequence-for-wgrad it keeps the gathered input for W
    instead: ``gathered_for_w_steps``)
    split by tp (each rank holds heads / tp, ffn / tp):
        Q, K, V 3e, attention output e, GELU input 4e, GELU output 4e            -> 12e
    attention core, per a s^2 b, split by tp:
        softmax output e, its dropout mask 1, dropout output e                   -> 2e + 1

The Llama family changes three of these terms (``g`` query groups, ``f = ffn / h``):

* grouped-query attention keeps K and V for ``g`` heads: Q, K, V ``(1 + 2 g / a) e`` (the QKV output) and a
  copy of Q taken out of the grouped layout ``e``; with rotary embeddings (the fused kernel of
  ``kernels/rotary.py``) attention keeps the rotated Q, the rotated K widened to ``a`` heads and a
  contiguous ``g``-head copy instead, ``(2 + g / a) e``;
* SwiGLU (the fused kernel of ``kernels/swiglu.py``) keeps the gate/up output ``2 f e`` and its result
  ``f e`` (``3 f e`` against GELU's ``2 f e``);
* RMSNorm (the fused kernel) keeps its input ``e`` and one float32 ``1 / rms`` per row, as LayerNorm keeps
  its input ``e``.

Qwen3 changes two more: ``--kv-channels d`` makes the attention ``a d`` wide instead of ``h``, so the Q, K, V,
rotary and attention-output terms scale by ``a d / h``; ``--qk-layernorm`` keeps the norms' inputs, Q and K
``(1 + g / a) e``, and their per-head statistics (RMSNorm one float32 per head and token, LayerNorm two).

Multi-latent attention (``--multi-latent-attention``, docs/models.md; ``n``, ``r``, ``v`` the per-head no-position,
position and value features, ``c`` and ``c_q`` the kv and query latents) keeps, beside the norms and the MLP: the
latents' norm inputs and outputs ``2 c e + 2 c_q e`` with their fp32 statistics (whole on each tp rank, split with
sequence parallelism; the down-projections read the attention input already counted), and per head (split by tp)
q and k ``2 (n + r) e``, v as a view of the kv up-projection's ``(n + v) e`` output, the output ``v e`` and its
merged copy ``v e`` with the flash log-sum-exp. Value heads narrower than query heads send SDPA on CPU down its
math path: the ``[s, s]`` probabilities ``4 a s`` (12 with dropout), fp32 q, k and v for 16-bit, no output copy.
Selective recompute keeps the core's inputs instead: the q up-projection's output, the kv one's, and the whole
kv down-projection output under its ``k_rope`` view.
With context parallelism or packed documents MLA runs the blockwise core (no ``[s, s]`` tensor, dropout included;
its lse ``4 a``): q and k ``2 (n + r) e``; at cp 1 v as the view ``(n + v) e`` and the output ``v e`` (laid out
sequence first, so merging the heads is a view); at cp > 1 the ring's contiguous copy of v (the all-to-all's
head-sharded one), its output and the merged copy, ``3 v e``; ``all_gather`` keeps q, the gathered keys and values
``cp (n + r + v) e`` and the output ``v e`` instead of the local ones.

An MoE layer (``--num-experts E``, top-k, expert hidden ``f_e``, docs/moe.md) keeps instead of the MLP's input
and terms, for its ``T = s b`` tokens (whole on every tp rank: the layer gathers sequence-parallel shards) and
``N`` (token, expert) pairs (``T k``; with a capacity ``min(T k, E C)``, an upper bound as some experts take
fewer than ``C``; exactly ``E C`` when padded):

* the router's fp32 copy of its input ``4 T h``, its ``[T, E]`` logits/probabilities and ``[T, k]``, ``[N]``
  indices (small: ``(13 + 4 [e != 4]) T E + 12 T k + 12 N`` bytes);
* the experts' input ``N h e``, their SwiGLU ``3 f_e N e / tp`` (GELU ``2 f_e``), and the fp32 expert output
  and its router-weighted copy, ``8 N h``, that un-permutation keeps;
* a shared expert's MLP terms as a dense MLP of its hidden size (its input ``e``, split like the MLP input).

With expert parallelism a rank runs its local experts on the pairs it receives: ``T k`` under balanced routing,
the same ``N`` as one process. With ``--expert-tensor-parallel-size etp`` other than tp, a rank brings the
``N / tp`` pairs of its sequence shard (and keeps their ``8 h`` un-permutation terms) and its experts, split
over etp, run the ``N etp / tp`` pairs of their expert tp group: ``N etp / tp (h e + 3 f_e e / etp)``.
A stage's per-layer figure averages its MoE and dense layers over the model's
``--moe-layer-freq`` pattern.

These are the compiled kernels' figures (the default install, CPU and CUDA). The pure-PyTorch fallbacks
(``MEGATRON_LIKE_NO_CSRC=1``) keep more: silu(gate) ``f e`` more for SwiGLU, a float32 copy of the input
for RMSNorm.

Recomputation removes terms: ``selective`` keeps Q, K, V and re-runs the core (the ``a s^2 b`` terms
vanish); ``full`` keeps only each checkpointed group's input (``e s b h``, split by tp with sequence
parallelism) and re-creates one group's activations at a time during backward.

Pipeline schedules decide how many micro batches are alive on a rank: 1F1B keeps ``pp - p`` of them
on rank ``p`` (its warmup plus one); the interleaved schedule keeps ``2 (pp - p - 1) + (vp - 1) pp + 1``
model-chunk micro batches, each holding ``layers / (pp vp)`` layers.

Context parallelism (``--context-parallel-size cp``, docs/context_parallel.md) gives each rank ``s / cp`` of
every sequence: every term above counts ``s / cp`` tokens. Attention across the cp ranks runs the blockwise core,
which keeps no ``[s, s]`` tensor, only the float32 log-sum-exp ``4 a (s / cp) b / tp``; ``all_gather`` also keeps
the whole sequence's gathered K and V, ``2 (g / a) e s b h / tp``.

The first stage adds the embedding output (and its dropout mask), the last stage the final LayerNorm
input, the logits (e) and the cross entropy's fp32 exponentials ``[s, b, v / tp]``, alive for one micro
batch and freed before the layers' backward starts. With ``--mtp-num-layers D`` the last stage holds D more
layers per micro batch, each depth's norm inputs ``2e`` (split with sequence parallelism) and projection input
``2e`` (split too, but under a zero-bubble schedule), and D more logits buffers alive together with the main
one. Recomputation needs workspace during backward: one re-run attention core (selective) or one re-created
group of layers (full); the larger of the two transient amounts is added. ``block`` re-creates its first layers
only after the chunk's kept layers freed theirs, so it needs workspace only when every layer of the chunk is
recomputed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_like.config import Config
from megatron_like.config.parallel import SPLIT_BACKWARD_SCHEDULES
from megatron_like.planning.split_backward import (
    Stash,
    embedding_stash,
    held_at_peak,
    layer_stash,
    schedule_order,
)


@dataclass
class ActivationBytes:
    """Activation bytes of one pipeline rank at its peak (the start of its first steady backward)."""

    per_layer: float
    """Kept for backward by one layer for one micro batch (after recomputation)."""
    layers_alive: float
    """Layer-micro-batches whose activations are kept at once (schedule and recompute)."""
    stage_extra: float
    """Kept by the first stage's embedding for every micro batch alive (on the last stage: the multi-token
    prediction depths' inputs)."""
    transient: float
    """The larger of the last stage's logits and cross entropy buffers (one micro batch, freed before the
    layers' backward) and the backward workspace (a recomputed attention core or layer group)."""
    awaiting_w: float = 0.0
    """Under a zero-bubble schedule, the W stashes (deferred GEMMs' inputs and output gradients) of the micro
    batches whose W waits at the peak; under these and 1F1B (pipelined), the output gradients of the layer whose
    backward runs at the peak (``split_backward.py``)."""

    @property
    def total(self) -> float:
        return self.per_layer * self.layers_alive + self.stage_extra + self.transient + self.awaiting_w


def element_bytes(config: Config) -> int:
    """Bytes of one activation element: 2 with --fp16/--bf16, else 4."""
    return 2 if (config.precision.fp16 or config.precision.bf16) else 4


def local_seq_length(config: Config) -> int:
    """Tokens of each sequence one rank holds: ``--seq-length / --context-parallel-size``."""
    return config.model.seq_length // config.parallel.context_parallel_size


def layer_activation_bytes(config: Config, recompute: str | None = None, device: str = "cuda") -> float:
    """Bytes one transformer layer keeps for one micro batch on one tp rank (no full recompute).

    ``device`` matters for ``--attention-backend sdpa``: CUDA runs flash kernels (dropout included) that
    keep no ``[s, s]`` tensor; on CPU, attention dropout makes torch take its math path, which keeps the
    fp32 softmax, fp32 dropout mask and fp32 dropout output, and fp32 copies of q and k (and v for 16-bit).
    A sliding window shorter than the sequence and packed documents take the blockwise core with either backend,
    which keeps what flash attention keeps.
    """
    m, p = config.model, config.parallel
    s, b, h, a = local_seq_length(config), config.training.micro_batch_size, m.hidden_size, m.num_attention_heads
    tp, e = p.tensor_model_parallel_size, element_bytes(config)
    ffn_ratio, group_ratio = m.ffn_size / h, m.query_groups / a
    masks = 2 if m.hidden_dropout > 0 else 0
    norm_input = e if m.normalization == "LayerNorm" else e + 4 / h  # RMSNorm: input and fp32 1/rms per row
    replicated = (2 * norm_input + 2 * e + masks) * s * b * h / (tp if p.sequence_parallel else 1)
    if m.multi_latent_attention:
        latent, attention, core = mla_attention_terms(config, recompute, device)
        mlp = (3 if m.swiglu else 2) * e * m.ffn_size / h
        replicated += latent * s * b / (tp if p.sequence_parallel else 1)
        split = (attention + mlp * h) * s * b / tp
        return replicated + split + core * s * b / tp + _moe_mlp_difference(config, mlp) \
            + gathered_for_w_steps(config)
    window = m.attention_window
    # context parallelism runs every mode on the blockwise core
    blockwise = (window is not None and window < m.seq_length) or config.data.reset_attention_mask \
        or p.context_parallel_size > 1
    qkv = (1 + 2 * group_ratio) * e
    if m.position_embedding_type == "rope":
        qkv += (2 + group_ratio) * e  # rotated Q, rotated K widened to a heads, a g-head copy
        if blockwise:  # its output is laid out sequence first: the merge of the heads is a view, not a copy
            qkv -= e
    elif m.query_groups != a:
        qkv += e  # Q copied out of the grouped QKV layout
    if m.qk_layernorm:  # the norms' inputs (Q and K heads) and their per-head fp32 statistics
        statistics = 4 if m.normalization == "RMSNorm" else 8
        qkv += (1 + group_ratio) * e + statistics * (a + m.query_groups) / (a * m.head_dim)
    width = m.attention_size / h  # heads x head_dim over h: 1 unless --kv-channels sets it apart
    mlp_matrices = 3 if m.swiglu else 2  # SwiGLU: gate/up output 2f, result f; GELU: input, output
    mlp = mlp_matrices * e * ffn_ratio
    split = ((qkv + e) * width + mlp) * s * b * h / tp
    replicated += _moe_mlp_difference(config, mlp)
    core = 0.0
    attention_dropout = m.attention_dropout > 0
    if recompute != "selective":
        if blockwise:  # model/blockwise_attention.py keeps no [s, s] tensor (dropout included), only its lse
            core = 4 * a * s * b / tp
            if p.context_parallel_size > 1 and p.cp_comm_type == "all_gather":  # and the gathered K and V
                core += 2 * group_ratio * e * m.seq_length * b * h / tp
        elif m.attention_core == "local":
            core = (e + (1 + e if attention_dropout else 0)) * a * s * s * b / tp
        elif device == "cpu" and attention_dropout:
            core = 12 * a * s * s * b / tp
            split += (8 if e == 4 else 12) * s * b * h * width / tp
        else:
            core = 4 * a * s * b / tp  # flash attention's log-sum-exp
    return replicated + split + core + gathered_for_w_steps(config)


def gathered_for_w_steps(config: Config) -> float:
    """Bytes per layer that a zero-bubble schedule with --keep-gathered-sequence-for-wgrad keeps beyond the formula
    under sequence parallelism at tp > 1: its column-parallel linears' W steps keep their gathered ``[s, b, in]``
    inputs, where by default (and in the other schedules) they keep the ``[s / tp, b, in]`` shards and gather them
    again (``tensor_parallel/sequence_parallel_linear.py``).
    Adds ``(1 - 1 / tp) e s b`` times the inputs' widths: QKV's (or MLA's up-projections' latents) and MLP fc1's
    (an MoE layer's shared expert's); MLA's ``q_proj`` without a query latent keeps a gathered copy of the input
    whose shard the down-projection keeps too, ``e s b h``. 0 otherwise."""
    m, p = config.model, config.parallel
    tp = p.tensor_model_parallel_size
    if not (p.sequence_parallel and tp > 1 and p.pipeline_schedule in SPLIT_BACKWARD_SCHEDULES
            and p.keep_gathered_sequence_for_wgrad):
        return 0.0
    gathered = 1 - 1 / tp
    if not m.multi_latent_attention:
        attention = gathered * m.hidden_size
    elif m.q_lora_rank:
        attention = gathered * (m.q_lora_rank + m.kv_lora_rank)
    else:
        attention = m.hidden_size + gathered * m.kv_lora_rank
    pattern = m.moe_layer_pattern
    moe_fraction = sum(pattern) / len(pattern) if pattern else 0.0
    mlp = gathered * m.hidden_size * (1 - moe_fraction * (not m.moe_shared_expert_intermediate_size))
    return (attention + mlp) * element_bytes(config) * local_seq_length(config) * config.training.micro_batch_size


def _moe_mlp_difference(config: Config, mlp: float) -> float:
    """What the MoE layers change in the average layer's bytes: their share of the layers times (the MoE layer's
    terms less the dense MLP's; ``mlp`` is the latter's split term per ``s b h``; module docstring)."""
    m, p = config.model, config.parallel
    pattern = m.moe_layer_pattern
    moe_fraction = sum(pattern) / len(pattern) if pattern else 0.0
    if not moe_fraction:
        return 0.0
    s, b, h = local_seq_length(config), config.training.micro_batch_size, m.hidden_size
    tp, e = p.tensor_model_parallel_size, element_bytes(config)
    dense_mlp = e * s * b * h / (tp if p.sequence_parallel else 1) + mlp * s * b * h / tp
    return moe_fraction * (moe_mlp_activation_bytes(config) - dense_mlp)


def mla_attention_terms(config: Config, recompute: str | None, device: str) -> tuple[float, float, float]:
    """Multi-latent attention's bytes per token (module docstring), beyond the norms' and the MLP's:
    ``(latent terms, kept whole (split by tp with sequence parallelism); head terms, split by tp; the attention
    core's, split by tp)``."""
    m, e = config.model, element_bytes(config)
    a, nope, rope, v, c = m.num_attention_heads, m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim, m.kv_lora_rank
    s = local_seq_length(config)
    latent = 2 * e * c + 4  # the kv latent's norm input (a contiguous copy) and fp32 statistics, its output
    if m.q_lora_rank:
        latent += 2 * e * m.q_lora_rank + 4  # the q latent: norm input and statistics, norm output
    if recompute == "selective":  # the checkpointed core keeps its inputs: q, kv and k_rope (a view of kv_down's
        # output, which stays whole), and the output projection its input
        return latent + e * (c + rope), a * (e * (nope + rope) + e * (nope + v) + e * v), 0.0
    p = config.parallel
    if p.context_parallel_size > 1 or config.data.reset_attention_mask:
        return latent, mla_blockwise_head_bytes(config), 4 * a + mla_gathered_kv_bytes(config)
    dropout = m.attention_dropout > 0
    if device == "cpu" and (dropout or nope + rope != v):  # the math path (no flash kernel for these shapes)
        fp32 = 4 if e != 4 else e  # 16-bit: float32 copies of q, k and v
        qkv = 2 * fp32 * (nope + rope) + (fp32 * v if e != 4 else e * (nope + v))
        return latent, a * (qkv + e * v), (12 if dropout else 4) * a * s
    # flash / memory-efficient: q, k, v (a view of kv_up's output, kept whole), the output, fp32 log-sum-exp
    return latent, a * (2 * e * (nope + rope) + e * (nope + v) + 2 * e * v), 4 * a


def mla_blockwise_head_bytes(config: Config) -> float:
    """Bytes per token and all heads that multi-latent attention keeps around the blockwise core (context
    parallelism, packed documents; the lse is the core's term): q and k ``2 (n + r) e``, then by mode the values
    and the output (module docstring)."""
    m, e = config.model, element_bytes(config)
    a, qk, v = m.num_attention_heads, m.qk_head_dim + m.qk_pos_emb_head_dim, m.v_head_dim
    p = config.parallel
    if p.context_parallel_size == 1:  # v a view of the kv up-projection's output; the output laid out sequence first
        return a * e * (2 * qk + m.qk_head_dim + v + v)
    if p.cp_comm_type == "all_gather":  # the local keys and values are not kept, the gathered ones are (core term)
        return a * e * (qk + v)
    # the ring's contiguous copy of v (or the all-to-all's head-sharded one), its [b, h, s, v] output and the
    # merged copy the output projection keeps
    return a * e * (2 * qk + 3 * v)


def mla_gathered_kv_bytes(config: Config) -> float:
    """Bytes per local token and all heads of the whole sequence's keys and values that ``--cp-comm-type
    all_gather`` keeps for multi-latent attention: ``cp (n + r + v) e``; 0 otherwise."""
    m, p = config.model, config.parallel
    if p.context_parallel_size == 1 or p.cp_comm_type != "all_gather":
        return 0.0
    width = m.qk_head_dim + m.qk_pos_emb_head_dim + m.v_head_dim
    return p.context_parallel_size * m.num_attention_heads * width * element_bytes(config)


def routed_pairs(config: Config) -> int:
    """(Token, expert) pairs one micro batch sends through the experts: ``T k``, capped by the capacity."""
    m = config.model
    tokens, k, experts = local_seq_length(config) * config.training.micro_batch_size, m.moe_router_topk, m.num_experts
    if m.moe_expert_capacity_factor is None:
        return tokens * k
    capacity = min(tokens, math.ceil(m.moe_expert_capacity_factor * tokens * k / experts))
    return experts * capacity if m.moe_pad_expert_input_to_capacity else min(tokens * k, experts * capacity)


def moe_mlp_activation_bytes(config: Config) -> float:
    """Bytes one MoE layer's router, experts and shared expert keep for one micro batch on one rank."""
    m, p = config.model, config.parallel
    s, b, h = local_seq_length(config), config.training.micro_batch_size, m.hidden_size
    tp, e = p.tensor_model_parallel_size, element_bytes(config)
    tokens, pairs, experts = s * b, routed_pairs(config), m.num_experts
    mlp_matrices = 3 if m.swiglu else 2
    router = 4 * tokens * h + (13 + (4 if e != 4 else 0)) * tokens * experts + 12 * tokens * m.moe_router_topk \
        + 12 * pairs
    etp = tp if p.expert_tensor_parallel_size is None else p.expert_tensor_parallel_size
    if etp == tp:
        expert_terms = pairs * (h * e + mlp_matrices * m.moe_ffn_size * e / tp + 8 * h)
    else:  # a rank brings its shard's pairs and its experts run those of the etp ranks of their group
        own = pairs / tp
        expert_terms = own * etp * (h * e + mlp_matrices * m.moe_ffn_size * e / etp) + own * 8 * h
    shared = 0.0
    if m.moe_shared_expert_intermediate_size:
        shared = e * tokens * h / (tp if p.sequence_parallel else 1) \
            + mlp_matrices * m.moe_shared_expert_intermediate_size * e * tokens / tp
    return router + expert_terms + shared


def microbatches_alive(config: Config, pp_rank: int) -> float:
    """Model-chunk micro batches whose activations rank ``pp_rank`` keeps at once, times the chunk's share
    of the stage's layers (so the result multiplies a whole stage's layers)."""
    pp, vp, m = config.parallel.pipeline_model_parallel_size, config.virtual_pipeline_size, config.num_microbatches
    if vp == 1:
        return float(min(pp - pp_rank, m))
    chunks = min(2 * (pp - pp_rank - 1) + (vp - 1) * pp + 1, m * vp)
    return chunks / vp


def full_recompute_fraction(config: Config) -> float:
    """Share of a model chunk's layers whose forward runs again in backward under ``--recompute-granularity
    full`` (``uniform``: all of them; ``block``: the first ``--recompute-num-layers``); 0 otherwise."""
    m = config.model
    if m.recompute_granularity != "full":
        return 0.0
    chunk = m.num_layers // (config.parallel.pipeline_model_parallel_size * config.virtual_pipeline_size)
    return 1.0 if m.recompute_method == "uniform" else min(m.recompute_num_layers, chunk) / chunk


def activation_bytes(config: Config, pp_rank: int, padded_vocab_size: int, device: str = "cuda") -> ActivationBytes:
    """Peak activation bytes of a rank of pipeline stage ``pp_rank`` on ``device`` (module docstring)."""
    m, p = config.model, config.parallel
    s, b, h = local_seq_length(config), config.training.micro_batch_size, m.hidden_size
    tp, pp, e = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, element_bytes(config)
    sp_div = tp if p.sequence_parallel else 1
    stage_layers = m.num_layers // pp
    alive = microbatches_alive(config, pp_rank)
    granularity = m.recompute_granularity
    full_layer = layer_activation_bytes(config, granularity, device)
    if granularity == "full":
        n = m.recompute_num_layers
        group_input = e * s * b * h / sp_div
        chunk_layers = stage_layers // config.virtual_pipeline_size
        if m.recompute_method == "block":
            kept_per_chunk = min(n, chunk_layers) * group_input + max(chunk_layers - n, 0) * full_layer
            per_layer = kept_per_chunk / chunk_layers
            # The first n layers are re-created one at a time after the later (kept) layers of the same
            # micro batch ran their backward and freed at least one full layer: no extra peak then.
            workspace = full_layer if n >= chunk_layers else 0.0
        else:  # uniform: only the input of every group of n layers
            per_layer = group_input / n
            workspace = n * full_layer
    elif granularity == "selective":
        per_layer = full_layer
        workspace = layer_activation_bytes(config, None, device) - full_layer  # one re-run attention core
    else:
        per_layer, workspace = full_layer, 0.0
    embedding_per_microbatch = (e + (1 if m.hidden_dropout > 0 else 0)) * s * b * h / sp_div
    holds_loss = pp_rank == (0 if p.v_shape else pp - 1)  # the V's last stage is rank 0's second chunk
    depths = (m.mtp_num_layers or 0) if holds_loss else 0
    # Multi-token prediction: each depth is one more layer of the last chunk, kept like the others, plus its
    # two norm inputs and its projection's 2h input (the shard; gathered under a zero-bubble schedule with
    # --keep-gathered-sequence-for-wgrad); every depth's logits are alive at once.
    keeps_gathered = p.keep_gathered_sequence_for_wgrad and p.pipeline_schedule in SPLIT_BACKWARD_SCHEDULES
    projection_div = 1 if keeps_gathered else sp_div
    mtp_per_microbatch = depths * (2 * e / sp_div + 2 * e / projection_div) * s * b * h
    logits = (1 + depths) * (e * s * b * h / sp_div + (e + 4) * s * b * padded_vocab_size / tp) if holds_loss else 0.0
    if pp > 1 and (p.pipeline_schedule in SPLIT_BACKWARD_SCHEDULES or config.virtual_pipeline_size == 1):
        # What the loss keeps from its F to its B: the output layer's input and the cross entropy's fp32 exp.
        kept_by_loss = (1 + depths) * (e * s * b * h / sp_div + 4 * s * b * padded_vocab_size / tp) if holds_loss \
            else 0.0
        return _activation_bytes_by_order(config, pp_rank, per_layer, embedding_per_microbatch, depths,
                                          mtp_per_microbatch, kept_by_loss, workspace)
    embedding = embedding_per_microbatch * alive if pp_rank == 0 else 0.0
    return ActivationBytes(per_layer, alive * (stage_layers + depths), embedding + alive * mtp_per_microbatch,
                           max(logits, workspace))


def _activation_bytes_by_order(config: Config, pp_rank: int, per_layer: float, embedding_per_microbatch: float,
                               depths: int, mtp_per_microbatch: float, kept_by_loss: float,
                               workspace: float) -> ActivationBytes:
    """``activation_bytes`` under 1F1B or a zero-bubble schedule: whole activations and W stashes counted at the
    peak of the rank's own order (``split_backward.py``), a running B step adding one layer's output gradients.
    What the loss keeps counts with the loss chunk's micro batch (one at most: its F and B are adjacent in these
    orders)."""
    from megatron_like.pipeline_parallel.placement import ChunkPlacement

    pp, vp = config.parallel.pipeline_model_parallel_size, config.virtual_pipeline_size
    placement = ChunkPlacement(pp, vp, config.parallel.v_shape)
    chunk_layers = config.model.num_layers // (pp * vp)
    first = [placement.is_first(pp_rank, c) for c in range(vp)]
    last = [placement.is_last(pp_rank, c) for c in range(vp)]
    per_layer_stash, first_stage_stash = layer_stash(config), embedding_stash(config)
    backward_peak = per_layer_stash.output_grads  # 1F1B's backward makes (and frees) the same output gradients
    if config.parallel.pipeline_schedule not in SPLIT_BACKWARD_SCHEDULES:
        per_layer_stash = first_stage_stash = Stash(0.0, 0.0)
    whole = [per_layer * (chunk_layers + depths * last[c]) + embedding_per_microbatch * first[c]
             + (mtp_per_microbatch + kept_by_loss) * last[c] for c in range(vp)]
    stash = [Stash(per_layer_stash.inputs * chunk_layers + first_stage_stash.inputs * first[c],
                   per_layer_stash.output_grads * chunk_layers + first_stage_stash.output_grads * first[c])
             for c in range(vp)]
    held = held_at_peak(schedule_order(config, pp_rank), whole, stash, backward_peak)
    layers_alive = sum(n * (chunk_layers + depths * last[c]) for c, n in enumerate(held.whole))
    extra = sum(n * (embedding_per_microbatch * first[c] + (mtp_per_microbatch + kept_by_loss) * last[c])
                for c, n in enumerate(held.whole))
    waiting = sum(n * stash[c].total for c, n in enumerate(held.waiting))
    if held.in_backward is not None:
        waiting += backward_peak
    return ActivationBytes(per_layer, layers_alive, extra, workspace, waiting)
