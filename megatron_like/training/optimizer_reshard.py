"""Layout-independent optimizer state: merge the ZeRO shards of any (tp, pp, dp, zero stage) layout into
full per-parameter tensors and cut them into the shards of another layout.

``DistributedOptimizer.state_dict()`` of one rank holds AdamW's state per *segment* (the part of one
parameter inside the rank's shard of a bucket; see ``megatron_like/optimizer/distributed_optimizer.py``)
and, for 16-bit params, the fp32 master shard of every bucket. Which segment is which follows from the
bucket layout alone: ``build_units`` of the rank's model chunks and :class:`Bucket`'s arithmetic
(padding to a multiple of dp, rank r owns ``[r n / dp, (r + 1) n / dp)`` from ZeRO-1 on). So the layout
of any rank is rebuilt here from meta-device chunks, with no memory, no process group and no training
code run. Segment order in the inner AdamW: the 2-D parameters' segments in bucket order
(weight-decay group), then the 1-D ones.

Full state: ``{global parameter name: {"exp_avg", "exp_avg_sq"[, "master"]}}`` with the tensors of the
whole single-process parameter (tp shards merged by ``megatron_like.model.state.merge_tp``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_like.config import Config
from megatron_like.distributed.buffers import Bucket, build_units
from megatron_like.model import GPTModel, chunk_layers
from megatron_like.model.state import VOCAB_PARAMS, merge_tp, partition_dim, resize_vocab, split_tp, to_global_names
from megatron_like.parallel_state import ParallelState

KINDS = ("exp_avg", "exp_avg_sq", "master")


@dataclass
class Segment:
    """The part ``[param_lo, param_hi)`` of the flattened parameter ``name`` inside one rank's shard."""

    name: str
    shape: tuple[int, ...]
    decay: bool
    bucket: int
    shard_lo: int
    shard_hi: int
    param_lo: int
    param_hi: int


@dataclass
class RankLayout:
    """One rank's buckets (shard sizes) and segments, in the optimizer's order."""

    shard_sizes: list[int]
    segments: list[Segment]
    """Weight-decay segments first, then the others (the inner AdamW's parameter order)."""
    shapes: dict[str, tuple[int, ...]]
    """Every parameter this rank holds (global name -> its tp-local shape); tied copies excluded."""


def rank_layout(config: Config, padded_vocab_size: int, tp_rank: int, pp_rank: int, dp_rank: int) -> RankLayout:
    """The bucket layout of rank (tp_rank, pp_rank, dp_rank) of ``config``'s layout.

    The stage's chunks are built on the meta device without tensor parallelism (no process group is
    needed, so this also runs inside a distributed job); each parameter's tp-local shape follows from its
    partition dimension. Every tp rank has the same layout.
    """
    del tp_rank  # same bucket layout on every tp rank
    p = config.parallel
    tp, pp, vp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, config.virtual_pipeline_size
    dp = config.data_parallel_size
    sharded = p.zero_stage >= 1
    ps = ParallelState.single_process(torch.device("meta"))
    shard_sizes, decay, no_decay, shapes = [], [], [], {}
    with torch.device("meta"):
        for v in range(vp):
            layers = chunk_layers(config.model.num_layers, pp, pp_rank, vp, v)
            chunk = GPTModel(config.model, ps, vocab_size=padded_vocab_size, seed=0, layers=layers,
                             pre_process=pp_rank == 0 and v == 0, post_process=pp_rank == pp - 1 and v == vp - 1,
                             dtype=torch.float32)
            names = {id(param): name for name, param in
                     to_global_names(dict(chunk.named_parameters()), list(layers)).items()}
            local: dict[int, torch.Tensor] = {}
            for param in chunk.parameters():
                name = names[id(param)]
                shape = list(param.shape)
                dim = partition_dim(VOCAB_PARAMS[0] if name == "output_layer.weight" else name)
                if dim is not None:
                    shape[dim] //= tp
                local[id(param)] = torch.empty(shape)
                if pp_rank == pp - 1 and pp > 1 and name == "output_layer.weight" and \
                        not config.model.untie_embeddings_and_output_weights:
                    continue  # the last stage's tied copy of the embedding: the first stage's is canonical
                shapes[name] = tuple(shape)
            shared = chunk.shared_embedding_weight() if hasattr(chunk, "shared_embedding_weight") else None
            for _, bucket_params in build_units(chunk):
                for params in bucket_params:
                    bucket = Bucket([local[id(param)] for param in params], dp, dp_rank, sharded,
                                    is_shared_embedding=params[0] is shared)
                    index = len(shard_sizes)
                    shard_sizes.append(bucket.shard_numel)
                    originals = {id(local[id(param)]): param for param in params}
                    for stand_in, lo, hi, plo, phi in bucket.shard_segments():
                        param = originals[id(stand_in)]
                        segment = Segment(names[id(param)], tuple(stand_in.shape), stand_in.ndim > 1, index,
                                          lo, hi, plo, phi)
                        (decay if stand_in.ndim > 1 else no_decay).append(segment)
    return RankLayout(shard_sizes, decay + no_decay, shapes)


def _has_masters(config: Config) -> bool:
    return config.params_dtype_name != "float32"


def gather_full_optimizer(config: Config, padded_vocab_size: int, shards: dict[tuple[int, int, int], dict]
                          ) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
    """Merge every rank's ``DistributedOptimizer.state_dict()`` (keyed by (tp, pp, dp)) into full tensors.

    Returns (full state, one rank's state dict as a template of the hyperparameters and loss scaler).
    """
    p = config.parallel
    tp, pp, dp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, config.data_parallel_size
    if p.optimizer_cpu_offload:
        raise ValueError("optimizer state of --optimizer-cpu-offload runs is not resharded; pass --no-optimizer")
    kinds = KINDS if _has_masters(config) else KINDS[:2]
    full: dict[str, dict[str, torch.Tensor]] = {}
    for pp_rank in range(pp):
        local: list[dict[str, dict[str, torch.Tensor]]] = []
        for tp_rank in range(tp):
            tensors: dict[str, dict[str, torch.Tensor]] = {}
            for dp_rank in range(dp if p.zero_stage >= 1 else 1):
                layout = rank_layout(config, padded_vocab_size, tp_rank, pp_rank, dp_rank)
                for name, shape in layout.shapes.items():
                    tensors.setdefault(name, {k: torch.zeros(shape).reshape(-1) for k in kinds})
                state = shards[(tp_rank, pp_rank, dp_rank)]
                adam = state["optimizer"]["state"]
                masters = state.get("masters") or []
                for index, segment in enumerate(layout.segments):
                    if segment.name not in layout.shapes:  # the last stage's tied copy of the embedding
                        continue
                    target = tensors[segment.name]
                    for kind in ("exp_avg", "exp_avg_sq"):
                        if index in adam:
                            target[kind][segment.param_lo:segment.param_hi] = adam[index][kind].float()
                    if "master" in kinds:
                        target["master"][segment.param_lo:segment.param_hi] = \
                            masters[segment.bucket][segment.shard_lo:segment.shard_hi]
            local.append({name: {k: v.reshape(layout.shapes[name]) for k, v in by_kind.items()}
                          for name, by_kind in tensors.items()})
        for kind in kinds:
            merged = merge_tp([{name: t[kind] for name, t in rank.items()} for rank in local])
            for name, tensor in merged.items():
                full.setdefault(name, {})[kind] = tensor
    template = shards[(0, 0, 0)]
    return full, template


def _step_of(template: dict) -> torch.Tensor | None:
    for state in template["optimizer"]["state"].values():
        return state["step"].clone()
    return None


def shard_full_optimizer(config: Config, padded_vocab_size: int, full: dict[str, dict[str, torch.Tensor]],
                         template: dict, tp_rank: int, pp_rank: int, dp_rank: int) -> dict:
    """The ``DistributedOptimizer.state_dict()`` of rank (tp_rank, pp_rank, dp_rank) in ``config``'s layout."""
    tp = config.parallel.tensor_model_parallel_size
    layout = rank_layout(config, padded_vocab_size, tp_rank, pp_rank, dp_rank)
    tied_name = VOCAB_PARAMS[0]
    step = _step_of(template)
    kinds = [k for k in KINDS if k in next(iter(full.values()))]
    local: dict[str, dict[str, torch.Tensor]] = {}

    def local_tensor(name: str, kind: str) -> torch.Tensor:
        if name not in local:
            source = name if name in full else tied_name  # the last stage's tied copy of the embedding
            tensors = {}
            for k in kinds:
                tensor = full[source][k]
                if source in VOCAB_PARAMS:
                    tensor = resize_vocab(tensor, padded_vocab_size)
                tensors[k] = split_tp(tensor, source, tp, tp_rank).reshape(-1)
            local[name] = tensors
        return local[name][kind]

    adam_state, decay_ids, no_decay_ids = {}, [], []
    for index, segment in enumerate(layout.segments):
        entry = {k: local_tensor(segment.name, k)[segment.param_lo:segment.param_hi].clone()
                 for k in ("exp_avg", "exp_avg_sq")}
        if step is not None:
            adam_state[index] = {"step": step.clone(), **entry}
        (decay_ids if segment.decay else no_decay_ids).append(index)
    source_groups = template["optimizer"]["param_groups"]
    groups = []
    for ids, source in ((decay_ids, source_groups[0]), (no_decay_ids, source_groups[-1])):
        if ids:
            groups.append({**{k: v for k, v in source.items() if k != "params"}, "params": ids})
    if not groups:  # this rank's shards hold only padding: the optimizer steps one empty tensor
        groups = [{**{k: v for k, v in source_groups[-1].items() if k != "params"}, "params": [0]}]
    masters = []
    if "master" in kinds:
        masters = [torch.zeros(n) for n in layout.shard_sizes]
        for segment in layout.segments:
            masters[segment.bucket][segment.shard_lo:segment.shard_hi] = \
                local_tensor(segment.name, "master")[segment.param_lo:segment.param_hi]
    return {
        "optimizer": {"state": adam_state, "param_groups": groups},
        "masters": masters,
        "loss_scaler": template.get("loss_scaler"),
        "zero_stage": config.parallel.zero_stage,
        "dp_size": config.data_parallel_size,
        "dp_rank": dp_rank,
    }
