"""Layout-independent model weights: read a checkpoint of either format and any (tp, pp, vp) layout as full
weights, and cut this rank's chunk from them (generation, evaluation, the server, HF conversion).

A *full state* is the state dict of the whole single-process model with *global* layer indices
(``layers.7.mlp.fc1.weight``) and the vocabulary rows padded as saved. How each parameter splits over
tensor parallelism is read from the parameters themselves (``tensor_model_parallel`` and
``partition_dim``, set by the tensor-parallel layers), so a forked model with new parameters needs no
edit here. Training checkpoints change layout through torch.distributed.checkpoint instead
(``--ckpt-format torch_dist``, tools/checkpoint_reshard.py).

Checkpoint layouts read here (docs/checkpoints.md): torch_dist checkpoints hold full tensors already; the
torch format::

    <root>/latest_checkpointed_iteration.txt
    <root>/iter_0000100/mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt   {"config": ..., "model": [chunk states]}
    <root>/iter_0000100/mp_rank_{tp:02d}_{pp:03d}_{ep:03d}/...        the same, under expert parallelism

MoE expert weights (``expert_parallel``) are ``[E / ep, ...]`` on each expert-parallel rank: merged along
dim 0 in ep-rank order, and cut the same way for a model built at ``ep`` > 1 (docs/moe.md).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from collections.abc import Collection, Sequence

import torch
from torch import nn

from megatron_like.config import Config, ModelConfig
from megatron_like.model.gpt import WORD_EMBEDDINGS, GPTModel, chunk_layers
from megatron_like.parallel_state import ParallelState
from megatron_like.training.checkpointing import read_tracker, shard_dir_name

TRACKER_FILE = "latest_checkpointed_iteration.txt"
CHECKPOINT_FILE = "model_optim_rng.pt"
VOCAB_PARAMS = (WORD_EMBEDDINGS + ".weight", "output_layer.weight")
"""Parameters whose first dimension is the padded vocabulary."""
_LAYER = re.compile(r"^layers\.(\d+)\.")
_MTP_LAYER = re.compile(r"^mtp\.layers\.\d+\.")
MTP_EMBEDDING_COPY = "mtp_embedding.weight"
"""The untied last stage's copy of the word embedding for multi-token prediction (never in a full state)."""


class CheckpointLoadError(RuntimeError):
    """A checkpoint directory that cannot be read; the message says what is missing."""


# --------------------------------------------------------------------------------------------------
# How parameters split over tensor parallelism
# --------------------------------------------------------------------------------------------------


def _pattern(name: str) -> str:
    return _MTP_LAYER.sub("mtp.layers.*.", _LAYER.sub("layers.*.", name))


@functools.cache
def _tiny_models() -> tuple[GPTModel, ...]:
    """Tiny single-process models with every kind of parameter: a dense one with --qk-layernorm, a
    mixture-of-experts one with a shared expert (both with an untied output layer and an MTP depth, the MoE one's MoE)
    and multi-latent attention ones with and without the query latent."""
    dense = ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2, seq_length=4,
                        untie_embeddings_and_output_weights=True, qk_layernorm=True, mtp_num_layers=1)
    moe = ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2, seq_length=4, disable_bias_linear=True,
                      untie_embeddings_and_output_weights=True, num_experts=2, moe_router_topk=1,
                      moe_shared_expert_intermediate_size=8, mtp_num_layers=1)  # an MoE MTP layer too
    mla = ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2, seq_length=4, disable_bias_linear=True,
                      position_embedding_type="rope", multi_latent_attention=True, q_lora_rank=4, kv_lora_rank=4,
                      qk_head_dim=2, qk_pos_emb_head_dim=2, v_head_dim=2)
    mla_without_q_latent = dataclasses.replace(mla, q_lora_rank=None)
    return tuple(GPTModel(tiny, ParallelState.single_process(torch.device("cpu")), vocab_size=8, seed=0)
                 for tiny in (dense, moe, mla, mla_without_q_latent))


@functools.cache
def partition_rules() -> dict[str, int | None]:
    """Return ``{name pattern: partition dim or None (replicated)}`` of every GPT parameter.

    Read from the attributes of tiny single-process models, so the rules follow the model code; layer indices
    in the patterns are ``*``.
    """
    rules = {}
    for model in _tiny_models():
        rules.update({_pattern(name): (p.partition_dim if getattr(p, "tensor_model_parallel", False) else None)
                      for name, p in model.named_parameters()})
    return rules


@functools.cache
def _expert_patterns() -> frozenset[str]:
    return frozenset(_pattern(name) for model in _tiny_models() for name, p in model.named_parameters()
                     if getattr(p, "expert_parallel", False))


def is_expert(name: str) -> bool:
    """Whether parameter ``name`` holds experts along dim 0 (``[E, ...]``), split over expert parallelism."""
    return _pattern(name) in _expert_patterns()


def partition_dim(name: str) -> int | None:
    """The tensor-parallel split dimension of parameter ``name`` (None = every tp rank holds it whole)."""
    rules = partition_rules()
    pattern = _pattern(name)
    if pattern not in rules:
        raise KeyError(f"parameter {name!r} is not a GPT parameter (known: {', '.join(sorted(rules))})")
    return rules[pattern]


# --------------------------------------------------------------------------------------------------
# Local (chunk) names <-> global names; tp merge and split
# --------------------------------------------------------------------------------------------------


def to_global_names(chunk_state: dict[str, torch.Tensor], layers: Sequence[int]) -> dict[str, torch.Tensor]:
    """Rename a chunk's ``layers.<i>.`` (index in the chunk) to ``layers.<layers[i]>.`` (global index)."""
    return {_LAYER.sub(lambda m: f"layers.{layers[int(m.group(1))]}.", k): v for k, v in chunk_state.items()}


def _wanted(name: str, layers: Collection[int]) -> bool:
    """Whether ``name`` is outside the transformer layers or in one of ``layers`` (global indices)."""
    match = _LAYER.match(name)
    return match is None or int(match.group(1)) in layers


def _dim_or_replicated(name: str) -> int | None:
    """partition_dim, with entries the plain model does not have (e.g. QAT quantizer buffers) replicated."""
    try:
        return partition_dim(name)
    except KeyError:
        return None


def merge_tp(shards: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Full tensors from the state dicts of all tp ranks (in tp-rank order) of one chunk."""
    merged = {}
    for name, first in shards[0].items():
        if _pattern(name) not in partition_rules() and any(not torch.equal(s[name], first) for s in shards[1:]):
            raise CheckpointLoadError(f"{name!r} is not a GPT parameter and differs between tp ranks: "
                                      "cannot tell how to merge it")
        dim = _dim_or_replicated(name)
        merged[name] = first if dim is None else torch.cat([s[name] for s in shards], dim=dim)
    return merged


def merge_ep(shards: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One chunk's state from those of all ep ranks (in ep-rank order): experts concatenated along dim 0,
    everything else (replicated over ep) from the first."""
    return {name: torch.cat([s[name] for s in shards]) if is_expert(name) else first
            for name, first in shards[0].items()}


def split_ep(tensor: torch.Tensor, name: str, ep_size: int, ep_rank: int) -> torch.Tensor:
    """Ep rank ``ep_rank``'s experts of the full parameter ``name`` (the whole tensor for a non-expert one)."""
    if not is_expert(name) or ep_size == 1:
        return tensor
    if tensor.shape[0] % ep_size:
        raise ValueError(f"{name}: {tensor.shape[0]} experts do not split over --expert-model-parallel-size {ep_size}")
    return tensor.chunk(ep_size)[ep_rank]


def split_tp(tensor: torch.Tensor, name: str, tp_size: int, tp_rank: int) -> torch.Tensor:
    """Tp rank ``tp_rank``'s part of the full parameter ``name``."""
    dim = _dim_or_replicated(name)
    if dim is None or tp_size == 1:
        return tensor
    if tensor.shape[dim] % tp_size:
        raise ValueError(f"{name}: dimension {dim} of size {tensor.shape[dim]} does not split over tp {tp_size}")
    return tensor.chunk(tp_size, dim=dim)[tp_rank].clone()


def resize_vocab(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """Trim or zero-pad the padded-vocabulary rows of ``tensor [v, h]`` to ``rows`` (tp layouts pad differently)."""
    if tensor.shape[0] == rows:
        return tensor
    if tensor.shape[0] > rows:
        return tensor[:rows]
    return torch.cat([tensor, tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])])


def chunk_state(full: dict[str, torch.Tensor], config: ModelConfig, *, layers: range, pre_process: bool,
                post_process: bool, tp_size: int, tp_rank: int, padded_vocab_size: int, ep_size: int = 1,
                ep_rank: int = 0) -> dict[str, torch.Tensor]:
    """The state dict of one GPT chunk (local layer names, this tp and ep rank's slices) cut from a full state.

    A last chunk without the embedding gets ``output_layer.weight`` = the word embedding when tied (untied, with
    multi-token prediction: its ``mtp_embedding.weight`` copy).
    """
    out: dict[str, torch.Tensor] = {}
    position = {g: i for i, g in enumerate(layers)}
    for name, tensor in full.items():
        match = _LAYER.match(name)
        if match:
            layer = int(match.group(1))
            if layer not in position:
                continue
            local = _LAYER.sub(f"layers.{position[layer]}.", name)
        elif name.startswith("embedding."):
            if not pre_process:
                continue
            local = name
        elif name.startswith(("final_layernorm.", "output_layer.", "mtp.")):
            if not post_process:
                continue
            local = name
        else:
            raise KeyError(f"unexpected parameter {name!r} in the full state")
        if name in VOCAB_PARAMS:
            tensor = resize_vocab(tensor, padded_vocab_size)
        out[local] = split_tp(split_ep(tensor, name, ep_size, ep_rank), name, tp_size, tp_rank)
    tied = not config.untie_embeddings_and_output_weights
    if post_process and not pre_process and (tied or config.mtp_num_layers):
        word = split_tp(resize_vocab(full[VOCAB_PARAMS[0]], padded_vocab_size), VOCAB_PARAMS[0], tp_size, tp_rank)
        out["output_layer.weight" if tied else MTP_EMBEDDING_COPY] = word
    return out


# --------------------------------------------------------------------------------------------------
# Reading checkpoints
# --------------------------------------------------------------------------------------------------


def checkpoint_iteration_dir(root: str, iteration: int | None = None) -> str:
    """``<root>/iter_XXXXXXX`` of ``iteration`` (default: the latest one)."""
    if iteration is None:
        tracker = os.path.join(root, TRACKER_FILE)
        if os.path.isfile(root):
            raise CheckpointLoadError(f"--load {root} is a file; pass the checkpoint directory (the one holding "
                                      f"{TRACKER_FILE})")
        if not os.path.exists(tracker):
            raise CheckpointLoadError(f"--load {root} holds no {TRACKER_FILE}; is it a checkpoint directory?")
        iteration = read_tracker(tracker)
    path = os.path.join(root, f"iter_{iteration:07d}")
    if not os.path.isdir(path):
        raise CheckpointLoadError(f"checkpoint directory {path} is missing")
    return path


def _load(path: str, verify: bool = True) -> dict:
    # mmap: tensors are read only when used (verify reads the whole file once to check its checksums).
    # Imported here: the training package imports this module. Its errors are one line naming the file.
    from megatron_like.training.checkpoint_validation import read_checkpoint_file

    return read_checkpoint_file(path, mmap=True, verify=verify)


def is_torch_dist(it_dir: str) -> bool:
    """Whether the iteration directory ``it_dir`` holds a ``--ckpt-format torch_dist`` checkpoint (DCP's index)."""
    return os.path.exists(os.path.join(it_dir, ".metadata"))


def first_shard_dir(it_dir: str) -> str:
    """The torch format's ``mp_rank_00_000`` directory of iteration directory ``it_dir`` (``mp_rank_00_000_000``
    when saved at --expert-model-parallel-size > 1): it holds the saved config."""
    first, with_ep = (os.path.join(it_dir, shard_dir_name(0, 0, 0, ep)) for ep in (1, 2))
    return with_ep if not os.path.isdir(first) and os.path.isdir(with_ep) else first


def read_saved_config(root: str, iteration: int | None = None) -> Config:
    """The Config a checkpoint was saved with (from its first shard, or torch_dist's ``common.pt``)."""
    it_dir = checkpoint_iteration_dir(root, iteration)
    megatron = _megatron_checkpoint(it_dir)
    if megatron is not None:
        return megatron.config
    if is_torch_dist(it_dir):
        return Config.from_dict(_load(os.path.join(it_dir, "common.pt"))["config"])
    path = os.path.join(first_shard_dir(it_dir), CHECKPOINT_FILE)
    if not os.path.exists(path):
        raise CheckpointLoadError(f"checkpoint file {path} is missing")
    return Config.from_dict(_load(path, verify=False)["config"])  # its weights' load verifies the file


def load_full_state(root: str, iteration: int | None = None,
                    layers: Collection[int] | None = None) -> tuple[Config, dict[str, torch.Tensor]]:
    """Merge every ``mp_rank_TT_PPP`` shard of a checkpoint; return (saved config, full state).

    The full state has global layer names and the word embedding (and untied output layer) with the
    saved padded vocabulary; a tied copy of the embedding held by the last stage is dropped.
    ``layers``: merge only these global transformer layers (and every parameter outside the layers:
    embeddings, final LayerNorm, output layer), so a pipeline stage materializes its own share of a
    large checkpoint, not all of it (the shards are memory-mapped; unmerged tensors are never read).
    """
    it_dir = checkpoint_iteration_dir(root, iteration)
    megatron = _megatron_checkpoint(it_dir)
    if megatron is not None:  # Megatron-LM's own files: read whole (its names and fused layouts converted)
        from megatron_like.training.megatron_load import read_global_state

        return megatron.config, {k[len("model."):]: v for k, v in read_global_state(megatron, False).items()}
    config = read_saved_config(root, iteration)
    if is_torch_dist(it_dir):
        return config, _load_torch_dist_state(it_dir, layers)
    p, m = config.parallel, config.model
    tp, pp, vp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, config.virtual_pipeline_size
    ep = p.expert_model_parallel_size
    full: dict[str, torch.Tensor] = {}
    for pp_rank in range(pp):
        shards = []
        for tp_rank in range(tp):
            ep_chunks = []
            for ep_rank in range(ep):
                path = os.path.join(it_dir, shard_dir_name(tp_rank, pp_rank, ep_rank, ep), CHECKPOINT_FILE)
                if not os.path.exists(path):
                    raise CheckpointLoadError(f"checkpoint file {path} is missing (saved with tp {tp}, pp {pp}, "
                                              f"ep {ep})")
                ep_chunks.append(_load(path)["model"])
            shards.append([merge_ep([chunks[v] for chunks in ep_chunks]) for v in range(vp)])
        for v in range(vp):
            # The last stage's embedding copy for MTP (untied) is the first stage's word embedding: not merged.
            layers_here = chunk_layers(m.num_layers, pp, pp_rank, vp, v, p.v_shape)
            named = [{k: t for k, t in to_global_names(chunks[v], layers_here).items() if k != MTP_EMBEDDING_COPY}
                     for chunks in shards]
            if layers is not None:
                named = [{k: t for k, t in chunk.items() if _wanted(k, layers)} for chunk in named]
            full.update(merge_tp(named))
    if not m.untie_embeddings_and_output_weights:
        full.pop("output_layer.weight", None)
    return config, {k: v.clone() for k, v in full.items()}


def _megatron_checkpoint(it_dir: str):  # -> MegatronCheckpoint | None (the training package imports this module)
    """The opened Megatron-LM checkpoint of iteration directory ``it_dir``, or None when it is ours."""
    from megatron_like.training import megatron_load
    from megatron_like.training.checkpointing import CheckpointError

    try:
        kind = megatron_load.megatron_kind(it_dir)
        return None if kind is None else megatron_load.open_megatron(it_dir, kind)
    except CheckpointError as error:
        raise CheckpointLoadError(str(error)) from None


def _load_torch_dist_state(it_dir: str, layers: Collection[int] | None) -> dict[str, torch.Tensor]:
    """The ``model.<name>`` global tensors of a torch_dist checkpoint: already full, single-process names,
    the saved padded vocabulary, no tied copy (docs/checkpoints.md)."""
    # Imported here: the reader lives with the training side's DCP planners, which import the model package.
    from megatron_like.training.dist_checkpointing import model_keys, read_full_tensors

    root, name = os.path.split(it_dir.rstrip(os.sep))
    keys = [k for k in model_keys(it_dir) if layers is None or _wanted(k[len("model."):], layers)]
    tensors = read_full_tensors(root, keys, int(name[len("iter_"):]))
    return {k[len("model."):]: t for k, t in tensors.items()}


def load_into_model(model: Sequence[GPTModel], full: dict[str, torch.Tensor]) -> None:
    """Copy the slices of ``full`` that the chunks of this rank hold into them (strict: every key must match)."""
    for chunk in model:
        ps = chunk.ps
        layers = range(chunk.layers[0].layer, chunk.layers[-1].layer + 1) if len(chunk.layers) else range(0)
        state = chunk_state(full, chunk.config, layers=layers, pre_process=chunk.pre_process,
                            post_process=chunk.post_process, tp_size=ps.tp_size, tp_rank=ps.tp_rank,
                            padded_vocab_size=chunk.vocab_size, ep_size=ps.ep_size, ep_rank=ps.ep_rank)
        own = chunk.state_dict()
        missing = sorted(set(own) - set(state))
        if missing:
            raise CheckpointLoadError(f"the checkpoint lacks {', '.join(missing[:5])}"
                                      f"{' ...' if len(missing) > 5 else ''} (a different model?)")
        # Extra entries (e.g. quantizer statistics of a QAT run) are not part of the plain model.
        chunk.load_state_dict({k: v for k, v in state.items() if k in own})


def gather_full_state(model: Sequence[nn.Module]) -> dict[str, torch.Tensor]:
    """Full state of a single-process model (tp = pp = 1) with global layer names."""
    full: dict[str, torch.Tensor] = {}
    for chunk in model:
        layers = [layer.layer for layer in chunk.layers]
        full.update(to_global_names(chunk.state_dict(), layers))
    return full
