"""The scale simulator: memory and speed of every rank of a run, computed on one CPU without training.

For each distinct pipeline role (first stage, a middle stage, last stage) it builds that rank's real
model chunks with *meta* tensors (shapes, no memory) under PyTorch's fake process group of the full
world size, so parameter counts come from the model code itself, tensor-parallel splits included.
Per pipeline rank it then adds:

* weights, gradients and optimizer state from the ZeRO table of ``megatron_like.distributed.memory``
  (fp32 ``main_grad``; fp32 masters when params are 16-bit; optimizer state in host memory with
  ``--optimizer-cpu-offload``); with ``--num-experts`` the rank's ``E / ep`` experts, split over expert tp (the
  meta model holds only those slices), are sharded over the expert-data-parallel group of
  ``tp dp / (etp ep)`` ranks, the rest over dp;
* with expert parallelism, the bytes each rank sends through the token dispatcher per iteration
  (:func:`expert_parallel_bytes`);
* activations from :mod:`megatron_like.planning.activations` (micro batches alive under the pipeline
  schedule, recomputation, sequence parallelism);
* at ZeRO-2/3 the unsharded buffers of the units in use during backward (:func:`zero_transient_bytes`:
  full fp32 gradients of the chunk root and of one or two layers, ZeRO-3's gathered params);
* FLOPs per iteration (docs/design.md §8, plus the recomputed forward), the pipeline bubble
  ``(pp - 1) / (vp m)`` and a throughput estimate at an assumed fraction of the device's peak.

Every data-parallel and tensor-parallel rank of a stage holds the same amounts (up to padding), so the
table has one row per pipeline rank.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_like.config import Config
from megatron_like.distributed.buffers import build_units
from megatron_like.distributed.memory import StateBytes, theoretical_state_bytes
from megatron_like.model import GPTModel, chunk_layers
from megatron_like.parallel_state import ParallelState
from megatron_like.pipeline_parallel.placement import ChunkPlacement
from megatron_like.pipeline_parallel.v_schedules import zero_bubble_schedule_bubble
from megatron_like.planning.activations import ActivationBytes, activation_bytes, full_recompute_fraction
from megatron_like.planning.context_parallel import context_parallel_bytes
from megatron_like.training.metrics import flops_per_token

GIB = 2**30
PARAM_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class RankPlan:
    """Memory of one pipeline rank (every tp and dp rank of the stage holds the same)."""

    pp_rank: int
    params: int
    """Parameters this rank holds (its tp slices of its stage's layers, its ``E / ep`` experts)."""
    weight_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    """Optimizer state on the device (0 with CPU offload; see host_bytes)."""
    host_bytes: float
    """Optimizer state in host memory (CPU offload)."""
    activations: ActivationBytes
    zero_transient_bytes: float = 0.0
    """ZeRO-2/3's unsharded buffers of the units in use during backward (:func:`zero_transient_bytes`)."""
    expert_params: int = 0
    """Of ``params``, the expert weights (sharded by ZeRO over the expert-data-parallel group)."""
    dispatcher_bytes: float = 0.0
    """Bytes this rank sends through the MoE token dispatcher per iteration (:func:`expert_parallel_bytes`)."""
    cp_bytes: float = 0.0
    """Bytes this rank sends for context-parallel attention per iteration (``planning/context_parallel.py``)."""

    @property
    def device_bytes(self) -> float:
        return (self.weight_bytes + self.grad_bytes + self.optimizer_bytes + self.activations.total
                + self.zero_transient_bytes)


@dataclass
class Plan:
    """What a run would need: per-rank memory and the speed estimate."""

    config: Config
    ranks: list[RankPlan]
    total_params: int
    """Parameters of the whole model (the tied embedding counted once), the MTP depths left out (as published
    counts do: DeepSeek-V3's 671B)."""
    active_params: int
    """Parameters one token meets: ``total_params`` less the experts it is not routed to (equal without MoE)."""
    flops_per_iteration: float
    bubble: float
    """Fraction of an iteration each device idles in the pipeline fill and drain."""
    iteration_seconds: float
    tokens_per_second: float
    mtp_params: int = 0
    """The multi-token prediction depths' parameters (``--mtp-num-layers``), beside ``total_params``."""
    mtp_active_params: int = 0
    """Of ``mtp_params``, those one token meets."""

    @property
    def max_device_bytes(self) -> float:
        return max(r.device_bytes for r in self.ranks)


@contextlib.contextmanager
def fake_world(world_size: int, rank: int) -> Iterator[None]:
    """A fake process group of ``world_size`` in which this process is ``rank`` (collectives do nothing)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise RuntimeError("the simulator needs a process without a real process group")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@dataclass
class StageParams:
    """Parameter counts of one pipeline stage's chunks (tp rank 0), by ZeRO unit."""

    total: int
    root_unit: int
    """The largest chunk root (embeddings, final LayerNorm, output layer): at ZeRO-3 gathered, and at
    ZeRO-2/3 its full gradient held, through the chunk's whole forward / backward."""
    layer_unit: int
    """The largest transformer layer: ZeRO-2/3's unit of gradient reduction, ZeRO-3's of gathering."""
    expert: int = 0
    """Of ``total``, the expert weights this rank holds (parameters marked ``expert_parallel``)."""
    mtp: int = 0
    """Of ``total``, the multi-token prediction depths' parameters (``mtp.*``)."""
    mtp_expert: int = 0
    """Of ``mtp``, the depths' expert weights."""


def count_stage_params(config: Config, padded_vocab_size: int, pp_rank: int) -> int:
    """Parameters held by tp rank 0 of pipeline stage ``pp_rank``: its chunks built on the meta device."""
    return stage_params(config, padded_vocab_size, pp_rank).total


def stage_params(config: Config, padded_vocab_size: int, pp_rank: int) -> StageParams:
    """:class:`StageParams` of tp rank 0 of pipeline stage ``pp_rank``: its chunks built on the meta device,
    grouped into units as ``megatron_like.distributed.buffers.build_units`` does."""
    p = config.parallel
    tp, pp, vp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, config.virtual_pipeline_size
    world = config.world_size
    rank = pp_rank * (world // pp)  # tp rank 0, dp rank 0 of the stage
    parallel = copy.deepcopy(p)
    parallel.distributed_backend = None
    with fake_world(world, rank):
        ps = ParallelState.initialize(parallel, world)
        ps.device = torch.device("meta")
        total = root_unit = layer_unit = expert = mtp = mtp_expert = 0
        placement = ChunkPlacement(pp, vp, p.v_shape)
        with torch.device("meta"):
            for v in range(vp):
                chunk = GPTModel(config.model, ps, vocab_size=padded_vocab_size, seed=0,
                                 layers=chunk_layers(config.model.num_layers, pp, pp_rank, vp, v, p.v_shape),
                                 pre_process=placement.is_first(pp_rank, v),
                                 post_process=placement.is_last(pp_rank, v),
                                 sequence_parallel=p.sequence_parallel, dtype=torch.float32)
                total += sum(param.numel() for param in chunk.parameters())
                expert += sum(param.numel() for param in chunk.parameters() if getattr(param, "expert_parallel", False))
                if chunk.mtp is not None:
                    mtp += sum(param.numel() for param in chunk.mtp.parameters())
                    mtp_expert += sum(param.numel() for param in chunk.mtp.parameters()
                                      if getattr(param, "expert_parallel", False))
                for module, buckets in build_units(chunk):
                    size = sum(param.numel() for bucket in buckets for param in bucket)
                    if module is chunk:
                        root_unit = max(root_unit, size)
                    else:
                        layer_unit = max(layer_unit, size)
    assert tp == ps.tp_size
    return StageParams(total, root_unit, layer_unit, expert, mtp, mtp_expert)


def zero_transient_bytes(config: Config, stage: StageParams, param_bytes: int) -> float:
    """Unsharded buffers ZeRO-2/3 hold during backward on top of their shards (``docs/distributed.md``).

    Stage 2/3: the fp32 gradient of the chunk root (alive through the whole backward) and of one layer
    being accumulated, plus with ``--overlap-grad-reduce`` one more whose reduction is in flight.
    Stage 3 also gathers the root's and one layer's parameters, two layers' with ``--overlap-param-gather``
    (the next one is prefetched while one computes).
    """
    p = config.parallel
    if p.zero_stage < 2 or config.data_parallel_size * p.context_parallel_size == 1:
        return 0.0
    layers_in_flight = 2 if p.overlap_grad_reduce else 1
    grads = 4.0 * (stage.root_unit + layers_in_flight * stage.layer_unit)
    layers_gathered = 2 if p.overlap_param_gather else 1
    params = param_bytes * (stage.root_unit + layers_gathered * stage.layer_unit) if p.zero_stage == 3 else 0.0
    return grads + params


def state_bytes(config: Config, stage: StageParams, param_bytes: int, separate_master: bool) -> StateBytes:
    """Weights, gradients and optimizer state of one rank: dense parameters ZeRO-sharded over dp x cp, the rank's
    expert slices over the expert-data-parallel group (``tp cp dp / (etp ep)`` ranks holding the same ones)."""
    p = config.parallel
    dp = config.data_parallel_size * p.context_parallel_size  # the ranks holding the same parameters
    dense = theoretical_state_bytes(stage.total - stage.expert, dp, p.zero_stage, param_bytes, separate_master)
    experts = theoretical_state_bytes(stage.expert, expert_layout(config)[2], p.zero_stage, param_bytes,
                                      separate_master)
    return StateBytes(dense.params + experts.params, dense.grads + experts.grads, dense.optimizer + experts.optimizer)


def stage_moe_layers(config: Config, pp_rank: int) -> int:
    """MoE layers held by pipeline stage ``pp_rank`` (all its virtual chunks)."""
    p, m = config.parallel, config.model
    pp, vp = p.pipeline_model_parallel_size, config.virtual_pipeline_size
    return sum(m.is_moe_layer(layer) for v in range(vp)
               for layer in chunk_layers(m.num_layers, pp, pp_rank, vp, v, p.v_shape))


def expert_layout(config: Config) -> tuple[int, int, int]:
    """``(etp, ep, expert_dp)``: the experts' layout over the ``tp x cp x dp`` ranks of a stage (docs/moe.md)."""
    p = config.parallel
    tp, ep = p.tensor_model_parallel_size, p.expert_model_parallel_size
    etp = tp if p.expert_tensor_parallel_size is None else p.expert_tensor_parallel_size
    return etp, ep, tp * p.context_parallel_size * config.data_parallel_size // (etp * ep)


def expert_parallel_bytes(config: Config, pp_rank: int) -> float:
    """Bytes one rank of stage ``pp_rank`` sends through the token dispatcher in one iteration (as
    ``collectives.count_traffic`` counts them), assuming balanced routing.

    Per MoE layer and micro batch, a rank brings ``T`` tokens: the whole ``s b`` with expert tp = tp (the tp
    ranks hold the same tokens), its sequence shard ``s b / tp`` otherwise. ``ep`` ranks, element size ``e``
    (fp32 where the code computes in fp32):

    * ``alltoall``: each pass sends the ``T k (ep - 1) / ep`` pairs bound for other ranks' experts, ``h e``
      bytes each: dispatch and combine forward, their mirrors backward (4 passes), plus the ``E`` per-expert
      counts (int64) once per forward. With etp != tp the ``T k`` pairs a rank receives also go to the other
      ``etp - 1`` ranks of its expert tp group and their partial outputs come back (4 more passes of
      ``(etp - 1) T k`` rows), plus the all-gather of the ``E`` received counts;
    * ``allgather``: forward all-gathers tokens (``e``), router probabilities (fp32 ``[T, E]``) and routing map
      (uint8) and reduce-scatters the fp32 outputs, each a ring sending ``(G - 1) T`` rows over the ``G``
      ranks holding one copy of every expert (``ep``, or ``etp ep`` with etp != tp); backward reduce-scatters
      the token and probability gradients and all-gathers the fp32 output gradient.

    Not counted: the layer's own sequence-parallel gathers (of its input, to route the whole micro batch).
    Full recomputation runs the forward's collectives again for the recomputed layers.
    """
    p, m = config.parallel, config.model
    etp, ep, _ = expert_layout(config)
    own_tokens = etp != p.tensor_model_parallel_size  # each rank brings its own sequence shard
    group = etp * ep if own_tokens else ep
    if group == 1 or m.num_experts is None:
        return 0.0
    from megatron_like.planning.activations import element_bytes

    local_seq_length = m.seq_length // p.context_parallel_size
    tokens, h, e, experts, k = (local_seq_length * config.training.micro_batch_size, m.hidden_size,
                                element_bytes(config), m.num_experts, m.moe_router_topk)
    if own_tokens:
        tokens //= p.tensor_model_parallel_size
    if m.moe_token_dispatcher_type == "alltoall":
        one_pass = tokens * k * (ep - 1) / ep * h * e
        counts = 8 * experts * (ep - 1) / ep
        if own_tokens:
            one_pass += (etp - 1) * tokens * k * h * e
            counts += 8 * experts * (etp - 1)
        forward, backward = 2 * one_pass + counts, 2 * one_pass
    else:
        rows = (group - 1) * tokens
        forward = rows * (h * e + 4 * experts + experts + 4 * h)
        backward = rows * (h * e + 4 * experts + 4 * h)
    per_layer = forward * (1 + full_recompute_fraction(config)) + backward
    return per_layer * stage_moe_layers(config, pp_rank) * config.num_microbatches


def plan_run(config: Config, padded_vocab_size: int, device_tflops: float = 312.0,
             efficiency: float = 0.45, device: str = "cuda") -> Plan:
    """Memory of every pipeline rank and the speed estimate of ``config`` (see the module docstring).

    ``device_tflops`` is one device's peak for the run's dtype; ``efficiency`` the fraction of it the
    matmuls reach outside the pipeline bubble; ``device`` ("cuda" or "cpu") selects the attention kernels
    whose activations are counted.
    """
    p, m = config.parallel, config.model
    pp = p.pipeline_model_parallel_size
    roles = sorted({0, min(1, pp - 1), pp - 1})
    counts = {r: stage_params(config, padded_vocab_size, r) for r in roles}
    param_bytes = PARAM_BYTES[config.params_dtype_name]
    separate_master = param_bytes != 4 or p.optimizer_cpu_offload
    ranks = []
    for pp_rank in range(pp):
        stage = counts[pp_rank if pp_rank in counts else min(1, pp - 1)]
        state = state_bytes(config, stage, param_bytes, separate_master)
        offloaded = p.optimizer_cpu_offload
        ranks.append(RankPlan(
            pp_rank=pp_rank, params=stage.total, weight_bytes=state.params, grad_bytes=state.grads,
            optimizer_bytes=0 if offloaded else state.optimizer, host_bytes=state.optimizer if offloaded else 0,
            activations=activation_bytes(config, pp_rank, padded_vocab_size, device),
            zero_transient_bytes=zero_transient_bytes(config, stage, param_bytes), expert_params=stage.expert,
            dispatcher_bytes=expert_parallel_bytes(config, pp_rank), cp_bytes=context_parallel_bytes(config, pp_rank),
        ))
    single = copy.deepcopy(config)
    single.parallel.tensor_model_parallel_size = single.parallel.pipeline_model_parallel_size = 1
    single.parallel.expert_model_parallel_size = single.parallel.context_parallel_size = 1
    single.parallel.expert_tensor_parallel_size = None
    single.parallel.num_layers_per_virtual_pipeline_stage = None
    single.world_size = 1
    whole = stage_params(single, padded_vocab_size, 0)
    total_params, mtp_params = whole.total - whole.mtp, whole.mtp
    active_params, mtp_active_params = total_params, mtp_params
    if m.num_experts:  # a token visits k of the E experts of each MoE layer
        unvisited = (m.num_experts - m.moe_router_topk) / m.num_experts
        active_params -= round((whole.expert - whole.mtp_expert) * unvisited)
        mtp_active_params -= round(whole.mtp_expert * unvisited)
    tokens = config.global_batch_size * m.seq_length
    flops = flops_per_token(config, padded_vocab_size) * tokens
    layer_fraction = 1.0 - padded_vocab_size * m.hidden_size * 6.0 / flops_per_token(config, padded_vocab_size)
    if m.recompute_granularity == "full":
        flops += flops * layer_fraction / 3.0  # one more forward of the layers (2 of the 6 N)
    elif m.recompute_granularity == "selective":
        flops += 4.0 * m.num_layers * m.seq_length * m.seq_length * m.attention_size * config.global_batch_size
    vp, micro = config.virtual_pipeline_size, config.num_microbatches
    bubble = (pp - 1) / (vp * micro + pp - 1)
    if p.pipeline_schedule in ("zb-h1", "zb-v", "dualpipev"):
        # Per token: forward F = flops / 3 (one third of 6N plus attention), W = the weight GEMMs' 2N (at most
        # F), B = the rest of the backward. ZB-H1 idles (p-1)(F+B-W) of m(F+B+W) (pipeline_parallel/zero_bubble.py);
        # the V schedules' step times are a chunk's, half of those (pipeline_parallel/v_schedules.py).
        forward = flops / 3.0
        weight = min(2.0 * active_params * tokens, forward)
        bubble = zero_bubble_schedule_bubble(p.pipeline_schedule, pp, micro, forward, 2.0 * forward - weight, weight)
    compute_seconds = flops / config.world_size / (device_tflops * 1e12 * efficiency)
    iteration_seconds = compute_seconds / (1.0 - bubble)
    return Plan(config, ranks, total_params, active_params, flops, bubble, iteration_seconds,
                tokens / iteration_seconds, mtp_params, mtp_active_params)


def format_plan(plan: Plan, device_memory_gib: float) -> str:
    """The per-rank table and summary lines ``tools/plan.py`` prints."""
    c, p = plan.config, plan.config.parallel
    etp, ep, edp = expert_layout(c)
    experts = f", ep {ep} (expert-dp {edp})" if ep > 1 else ""
    if etp != p.tensor_model_parallel_size:
        experts = f", experts etp {etp} x ep {ep} x expert-dp {edp}"
    active = f" (active per token: {plan.active_params / 1e9:.3f} B)" if plan.active_params != plan.total_params else ""
    if plan.mtp_params:
        active += (f"; MTP depths {plan.mtp_params / 1e9:.3f} B more (active {plan.mtp_active_params / 1e9:.3f} B)"
                   if plan.mtp_active_params != plan.mtp_params else f"; MTP depths {plan.mtp_params / 1e9:.3f} B more")
    lines = [
        f" > plan: world {c.world_size} = tp {p.tensor_model_parallel_size} x pp {p.pipeline_model_parallel_size}"
        + (f" x cp {p.context_parallel_size} ({p.cp_comm_type})" if p.context_parallel_size > 1 else "")
        + f" x dp {c.data_parallel_size} (vp {c.virtual_pipeline_size}){experts}, zero stage {p.zero_stage}, "
        f"{c.params_dtype_name}, sequence parallel {p.sequence_parallel}, recompute "
        f"{c.model.recompute_granularity or 'none'}, micro batches {c.num_microbatches} x "
        f"{c.training.micro_batch_size}",
        f" > model parameters: {plan.total_params / 1e9:.3f} B{active}",
        "",
        f"{'pp rank':>7} | {'params (M)':>10} | {'weights':>8} | {'grads':>8} | {'optimizer':>9} | "
        f"{'act/layer':>9} | {'layers alive':>12} | {'activations':>11} | {'zero tmp':>8} | {'total GiB':>9}",
        "-" * 117,
    ]
    for r in plan.ranks:
        a = r.activations
        lines.append(
            f"{r.pp_rank:>7} | {r.params / 1e6:>10.1f} | {r.weight_bytes / GIB:>8.2f} | {r.grad_bytes / GIB:>8.2f} | "
            f"{r.optimizer_bytes / GIB:>9.2f} | {a.per_layer / GIB:>9.3f} | {a.layers_alive:>12.1f} | "
            f"{a.total / GIB:>11.2f} | {r.zero_transient_bytes / GIB:>8.2f} | {r.device_bytes / GIB:>9.2f}"
        )
    host = max(r.host_bytes for r in plan.ranks)
    lines += [
        "-" * 117,
        "(every tp and dp rank of a pipeline stage holds the same; GiB per device)",
        f" > FLOPs per iteration: {plan.flops_per_iteration:.3e} | pipeline bubble: {plan.bubble:.1%} | "
        f"estimated iteration time: {plan.iteration_seconds:.2f} s | estimated throughput: "
        f"{plan.tokens_per_second:,.0f} tokens/s",
    ]
    if p.pipeline_schedule in ("zb-h1", "zb-v", "dualpipev"):
        stashed = max(plan.ranks, key=lambda r: r.activations.awaiting_w)
        kept = ""
        if p.sequence_parallel:
            kept = " (gathered sequence kept)" if p.keep_gathered_sequence_for_wgrad else " (sequence shards)"
        lines.append(f" > W stashes{kept} (deferred weight gradients' inputs and output gradients) in the activations: "
                     f"up to {stashed.activations.awaiting_w / GIB:.2f} GiB, on pp rank {stashed.pp_rank}")
    dispatcher = max(r.dispatcher_bytes for r in plan.ranks)
    if dispatcher:
        lines.append(f" > expert-parallel {c.model.moe_token_dispatcher_type} bytes sent per rank per iteration "
                     f"(balanced routing): {dispatcher / GIB:.2f} GiB")
    cp_bytes = max(r.cp_bytes for r in plan.ranks)
    if cp_bytes:
        lines.append(f" > context-parallel {p.cp_comm_type} attention bytes sent per rank per iteration: "
                     f"{cp_bytes / GIB:.2f} GiB")
    if host:
        lines.append(f" > host memory for offloaded optimizer state per device: {host / GIB:.2f} GiB")
    lines.append(f"max memory per device: {plan.max_device_bytes / GIB:.2f} GiB (limit {device_memory_gib:g} GiB)")
    return "\n".join(lines)
