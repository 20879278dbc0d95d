"""Activation memory under the zero-bubble schedules (``--pipeline-schedule zb-h1 | zb-v | dualpipev``).

Their backward is split into B and W (``tensor_parallel/weight_grad.py``): B frees a micro batch's activations
but for what its W step needs, every deferred GEMM's input and output gradient (the *W stash*), which stays
until W. So a rank holds, at any point of its order, the whole activations of the (chunk, micro batch) pairs
between their F and B and the W stash of those between their B and W; its peak is the largest such sum over the
order (:func:`held_at_peak`), read from the schedule's own step list (``pipeline_parallel``), since the two
counts peak at different steps.

The W stash of one layer and micro batch (:func:`layer_stash`), per tp rank, ``e`` bytes an element, ``T = s b``
tokens: each column-parallel linear keeps its input and its ``out / tp`` output gradient; each row-parallel linear
its ``in / tp`` input and its ``h`` output gradient. Under sequence parallelism at tp > 1 the column's input and
the row's output gradient are the sequence shards ``T / tp`` (gathered again in W,
``tensor_parallel/sequence_parallel_linear.py``), or with ``--keep-gathered-sequence-for-wgrad`` the gathered
``T``: :func:`sequence_shards` is the divisor ``n`` (tp or 1):

* attention ``T (h / n + q_out / tp) + T (a d / tp + h / n)`` with ``q_out = a d + 2 g d`` (QKV); multi-latent
  attention: the q (or q_up) and kv_up projections and the output projection (its down projections are replicated
  and get their gradients during B);
* MLP ``T (h / n + f_1 / tp) + T (f / tp + h / n)``, ``f_1 = 2f`` with SwiGLU;
* MoE layers: the fp32 router ``4 T (h + E)`` (each tp rank routes the whole sequence; a 16-bit router weight is
  cast, so not a leaf: its gradient is taken in B), the experts ``P etp / tp (2h + (f_1 + f) / etp)`` over the ``P``
  routed pairs, and the shared expert as an MLP.

The first stage's word (and learned position) embedding keeps its token ids (int64) and output gradient
``T h``. The output layer takes its weight gradient in B (its output gradient is ``v / h`` times its input).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from megatron_like.config import Config
from megatron_like.config.parallel import SPLIT_BACKWARD_SCHEDULES
from megatron_like.pipeline_parallel.trace import Step


def schedule_order(config: Config, pp_rank: int) -> list[Step]:
    """The step list of ``pp_rank`` under the run's 1F1B or zero-bubble schedule and number of micro batches."""
    from megatron_like.pipeline_parallel.schedules import one_f_one_b_steps
    from megatron_like.pipeline_parallel.v_schedules import dualpipev_steps, zb_v_steps
    from megatron_like.pipeline_parallel.zero_bubble import zb_h1_steps

    orders: dict[str | None, Callable[[int, int, int], list[Step]]] = {
        None: one_f_one_b_steps, "1f1b": one_f_one_b_steps, "zb-h1": zb_h1_steps, "zb-v": zb_v_steps,
        "dualpipev": dualpipev_steps}
    return orders[config.parallel.pipeline_schedule](config.parallel.pipeline_model_parallel_size, pp_rank,
                                                     config.num_microbatches)


@dataclass(frozen=True)
class Stash:
    """Bytes a W step keeps from its B: the deferred GEMMs' inputs (activations the forward saved, which B then
    does not free) and their output gradients (made by B)."""

    inputs: float
    output_grads: float

    @property
    def total(self) -> float:
        return self.inputs + self.output_grads


@dataclass(frozen=True)
class HeldAtPeak:
    """Per model chunk, the micro batches a rank holds at its peak: whole (between F and B) and as a W stash
    (between B and W); ``in_backward``: the chunk whose B runs at the peak (its micro batch counted whole), if any."""

    whole: tuple[int, ...]
    waiting: tuple[int, ...]
    in_backward: int | None


def held_at_peak(steps: Sequence[Step], whole_bytes: Sequence[float], stash: Sequence[Stash],
                 backward_peak: float = 0.0) -> HeldAtPeak:
    """The counts at the point of ``steps`` where ``sum whole * whole_bytes + waiting * stash`` (per chunk) is
    largest. A B step adds ``backward_peak`` while its micro batch still counts whole: its first (last) layer's
    output gradients for W exist before that layer frees the rest of its activations."""
    chunks, split = len(whole_bytes), any(step.kind == "W" for step in steps)
    whole, waiting = [0] * chunks, [0] * chunks
    best, peak = -1.0, HeldAtPeak((0,) * chunks, (0,) * chunks, None)

    def consider(in_backward: int | None) -> None:
        nonlocal best, peak
        held = sum(n * size for n, size in zip(whole, whole_bytes)) + sum(n * k.total for n, k in zip(waiting, stash))
        if in_backward is not None:
            held += backward_peak
        if held > best:
            best, peak = held, HeldAtPeak(tuple(whole), tuple(waiting), in_backward)

    for kind, chunk, _ in steps:
        if kind == "F":
            whole[chunk] += 1
        elif kind == "B":
            consider(chunk)
            whole[chunk] -= 1
            waiting[chunk] += split  # without W steps a B frees everything
        else:
            waiting[chunk] -= 1
        consider(None)
    return peak


def sequence_shards(config: Config) -> int:
    """What a W stash's whole-sequence tensors (column-parallel inputs, row-parallel output gradients) are divided
    by: tp under sequence parallelism in a zero-bubble schedule (the shards, gathered again in W), else 1 (also
    with --keep-gathered-sequence-for-wgrad)."""
    p = config.parallel
    split_sp = p.sequence_parallel and p.pipeline_schedule in SPLIT_BACKWARD_SCHEDULES
    return p.tensor_model_parallel_size if split_sp and not p.keep_gathered_sequence_for_wgrad else 1


def _column_and_row_pair(tokens: float, hidden: int, column_out: float, row_in: float, shards: int) -> Stash:
    """Elements a column-parallel linear (``hidden`` -> ``column_out`` per rank) and a row-parallel one
    (``row_in`` per rank -> ``hidden``) keep for W; ``shards``: :func:`sequence_shards`."""
    return Stash(tokens * (hidden / shards + row_in), tokens * (column_out + hidden / shards))


def _scaled(stash: Stash, factor: float) -> Stash:
    return Stash(stash.inputs * factor, stash.output_grads * factor)


def _sum(*stashes: Stash) -> Stash:
    return Stash(sum(k.inputs for k in stashes), sum(k.output_grads for k in stashes))


def layer_stash(config: Config) -> Stash:
    """Bytes one transformer layer's W step keeps from its B for one micro batch on one tp rank (module
    docstring), averaged over the dense and MoE layers of ``--moe-layer-freq``'s pattern."""
    from megatron_like.planning.activations import element_bytes, local_seq_length, routed_pairs

    m, p = config.model, config.parallel
    tp, e, h = p.tensor_model_parallel_size, element_bytes(config), m.hidden_size
    tokens = local_seq_length(config) * config.training.micro_batch_size
    gated, n = 2 if m.swiglu else 1, sequence_shards(config)
    if m.multi_latent_attention:
        a = m.num_attention_heads
        q_in, kv_in = m.q_lora_rank or h, m.kv_lora_rank
        q_out, kv_out = a * (m.qk_head_dim + m.qk_pos_emb_head_dim) / tp, a * (m.qk_head_dim + m.v_head_dim) / tp
        attention = Stash(tokens * ((q_in + kv_in) / n + a * m.v_head_dim / tp), tokens * (q_out + kv_out + h / n))
    else:
        qkv_out = m.attention_size * (1 + 2 * m.query_groups / m.num_attention_heads)
        attention = _column_and_row_pair(tokens, h, qkv_out / tp, m.attention_size / tp, n)
    dense = _column_and_row_pair(tokens, h, gated * m.ffn_size / tp, m.ffn_size / tp, n)
    pattern = m.moe_layer_pattern
    moe_fraction = sum(pattern) / len(pattern) if pattern else 0.0
    mlp = dense
    if moe_fraction:
        # Every tp rank routes the whole (gathered) sequence. A 16-bit router weight is cast to fp32 in the forward,
        # so not a leaf: its gradient is taken in B.
        fp32_router = config.params_dtype_name == "float32"
        router = Stash(4 / e * tokens * h, 4 / e * tokens * m.num_experts) if fp32_router else Stash(0.0, 0.0)
        etp = tp if p.expert_tensor_parallel_size is None else p.expert_tensor_parallel_size
        pairs = routed_pairs(config) * etp / tp
        experts = Stash(pairs * (h + m.moe_ffn_size / etp), pairs * (gated * m.moe_ffn_size / etp + h))
        shared = Stash(0.0, 0.0)
        if m.moe_shared_expert_intermediate_size:
            f_shared = m.moe_shared_expert_intermediate_size
            shared = _column_and_row_pair(tokens, h, gated * f_shared / tp, f_shared / tp, n)
        mlp = _sum(_scaled(dense, 1 - moe_fraction), _scaled(_sum(router, experts, shared), moe_fraction))
    return _scaled(_sum(attention, mlp), e)


def embedding_stash(config: Config) -> Stash:
    """Bytes the first stage's embeddings keep from B to W for one micro batch: the token (and learned position)
    ids and the output gradient of each."""
    from megatron_like.planning.activations import element_bytes, local_seq_length

    m = config.model
    tokens = local_seq_length(config) * config.training.micro_batch_size
    lookups = 2 if m.position_embedding_type == "learned_absolute" else 1
    return Stash(lookups * tokens * 8, lookups * tokens * element_bytes(config) * m.hidden_size)
