"""Bytes one rank sends for context parallelism's attention (``model/context_parallel/``), as
``collectives.count_traffic`` counts them: the planner's figure, checked against the code by
``tests/distributed/test_context_parallel_traffic.py``.

Per layer and micro batch a rank holds ``s_l = s / cp`` tokens of ``b`` sequences; on a tp rank the attention
has ``a / tp`` query heads and ``g / tp`` key/value heads, queries and keys of ``d`` channels and values of ``d_v``
(``d_v = d`` but in multi-latent attention: ``d = qk_head_dim + qk_pos_emb_head_dim``, ``d_v = v_head_dim``,
``g = a``), element size ``e``. Its keys and values are ``KV = b (g / tp) s_l (d + d_v) e`` bytes. By
``--cp-comm-type`` (``A`` the all-to-all size, ``P`` the ring size):

* ``p2p`` (ring of ``P = cp``): forward sends the K/V block on ``P - 1`` times; backward sends it on ``P - 1``
  times again and each block's dK/dV ``P`` times (the last send brings it home), in the core's compute dtype
  (float32 for 16-bit activations: ``KV 4 / e``);
* ``all_gather``: forward all-gathers K and V (a ring all-gather sends ``(cp - 1) / cp`` of the gathered
  ``cp KV``), backward reduce-scatters their gradients (the same bytes);
* ``a2a`` (``A = cp``): q, k, v and the output each cross one all-to-all forward and their gradients one
  backward; a rank keeps ``1 / A`` of each, sending ``(A - 1) / A`` of ``Q + O + KV`` each way
  (``Q = b (a / tp) s_l d e``, the output ``O = b (a / tp) s_l d_v e``);
* ``a2a+p2p``: the all-to-all over ``A``, then the ring over ``P`` on the head-sharded tensors (the same bytes
  as the sequence-sharded ones).

Packed documents (``--reset-attention-mask``) add an all-gather of the int64 document ids ``[b, s]`` per layer
forward. Recomputation re-runs the forward's exchanges: ``selective`` re-runs the core attention of every layer,
``full`` the recomputed layers. The multi-token prediction depths (``--mtp-num-layers``) are layers of the last
stage. Not counted (a few bytes per token per micro batch, not per layer): the loss's all-reduce of two floats and
multi-token prediction's all-gathers of the token ids, labels and loss mask.
"""

from __future__ import annotations

from megatron_like.config import Config
from megatron_like.model.gpt import chunk_layers
from megatron_like.planning.activations import element_bytes, full_recompute_fraction


def cp_sizes(config: Config) -> tuple[int, int]:
    """``(all-to-all size, ring size)`` of the cp attention exchanges (1 where that part does not run)."""
    p = config.parallel
    cp, mode = p.context_parallel_size, p.cp_comm_type
    if mode == "a2a":
        return cp, 1
    if mode == "a2a+p2p":
        a2a, ring = p.hierarchical_context_parallel_sizes
        return a2a, ring
    return 1, cp


def attention_head_dims(config: Config) -> tuple[int, int, int]:
    """``(query/key head dim, value head dim, key/value heads)`` of the tensors cp attention exchanges: multi-latent
    attention sends full per-head keys (no-position and rope slices) and its own value head dim, one key/value head
    per query head."""
    m = config.model
    if m.multi_latent_attention:
        return m.qk_head_dim + m.qk_pos_emb_head_dim, m.v_head_dim, m.num_attention_heads
    return m.head_dim, m.head_dim, m.query_groups


def cp_layer_bytes(config: Config) -> tuple[float, float]:
    """``(forward, backward)`` bytes one rank sends in one layer's attention for one micro batch (module
    docstring); ``(0, 0)`` at cp 1."""
    m, p = config.model, config.parallel
    cp, tp = p.context_parallel_size, p.tensor_model_parallel_size
    if cp == 1:
        return 0.0, 0.0
    b, local_tokens, e = config.training.micro_batch_size, m.seq_length // cp, element_bytes(config)
    d, d_v, kv_heads = attention_head_dims(config)
    per_query_head = b * (m.num_attention_heads // tp) * local_tokens * e
    q, out = per_query_head * d, per_query_head * d_v
    kv = b * (kv_heads // tp) * local_tokens * (d + d_v) * e
    kv_compute = kv * 4 / e
    documents = 8 * b * m.seq_length * (cp - 1) / cp if config.data.reset_attention_mask else 0.0
    if p.cp_comm_type == "all_gather":
        return kv * (cp - 1) + documents, kv * (cp - 1)
    a2a, ring = cp_sizes(config)
    exchanged = (a2a - 1) / a2a * (q + out + kv)  # q, k, v and the output (or their gradients)
    ring_forward = (ring - 1) * kv
    ring_backward = (ring - 1) * kv + (ring * kv_compute if ring > 1 else 0.0)
    return exchanged + ring_forward + documents, exchanged + ring_backward


def context_parallel_bytes(config: Config, pp_rank: int) -> float:
    """Bytes one rank of pipeline stage ``pp_rank`` sends for cp attention in one iteration (all its layers, every
    micro batch, recomputation included)."""
    m, p = config.model, config.parallel
    forward, backward = cp_layer_bytes(config)
    pp, vp = p.pipeline_model_parallel_size, config.virtual_pipeline_size
    layers = sum(len(chunk_layers(m.num_layers, pp, pp_rank, vp, v)) for v in range(vp))
    if pp_rank == pp - 1:  # the multi-token prediction depths' layers
        layers += m.mtp_num_layers or 0
    # selective recomputation re-runs every layer's core attention, exchanges included
    recomputed = 1.0 if m.recompute_granularity == "selective" else full_recompute_fraction(config)
    return (forward * (1 + recomputed) + backward) * layers * config.num_microbatches
