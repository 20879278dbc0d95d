"""Load a checkpoint of any (tp, pp, ep) layout into the model chunk of this rank in the current layout.

Every rank reads the shards it needs through ``megatron_like.model.state`` (merge its pipeline stage's
layers to full weights, cut this rank's slices), so a checkpoint trained at tp=2 x pp=2 generates at
tp=2 x pp=1 or in one process. An MoE model at ``--expert-model-parallel-size`` ep > 1 holds ``E / ep``
experts per rank: the ep ranks are replicas of everything else that run the same tokens in lockstep, and
the token dispatcher brings each token to the rank of its expert (docs/moe.md). The tokenizer comes from the
flags or, by default, from the checkpoint's saved config.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from megatron_like.config import Config, DataConfig, ModelConfig
from megatron_like.config.compare import given_flag_conflicts
from megatron_like.model.gpt import GPTModel, chunk_layers
from megatron_like.model.state import load_full_state, load_into_model, read_saved_config
from megatron_like.parallel_state import ParallelState


@dataclass
class InferenceModel:
    """What generation, evaluation and the server need from a checkpoint."""

    model: list[GPTModel]
    """This rank's chunk (one element), in eval mode."""
    config: Config
    """The saved config with this run's parallel layout."""
    tokenizer: object | None
    """``build_tokenizer`` result (tokenize/detokenize/eod/vocab_size), or None: token ids only."""
    vocab_size: int
    """Real vocabulary (logits of the padding rows are dropped)."""
    eod: int | None
    """End-of-text id generation stops at (None: no tokenizer, never stop early)."""
    iteration: int | None = None


def build_tokenizer_for(data: DataConfig, vocab_size: int | None):
    """The tokenizer a DataConfig names; None for a mock-data run without a tokenizer (ids only)."""
    if data.tokenizer_type is None and data.mock_data:
        return None
    from megatron_like.data.tokenizer import build_tokenizer

    return build_tokenizer(data.tokenizer_type, data.vocab_file, data.merge_file, data.tokenizer_model, vocab_size)


def tokenizer_overrides(saved: DataConfig, cli: DataConfig | None) -> DataConfig:
    """The saved data section with the tokenizer flags given on this command line taking precedence."""
    data = copy.deepcopy(saved)
    if cli is not None and cli.tokenizer_type is not None:
        data.tokenizer_type = cli.tokenizer_type
        data.vocab_file, data.merge_file, data.tokenizer_model = cli.vocab_file, cli.merge_file, cli.tokenizer_model
        data.mock_data = False
    return data


def load_inference_model(load_dir: str, ps: ParallelState, *, cli_data: DataConfig | None = None,
                         iteration: int | None = None, dtype: torch.dtype = torch.float32,
                         with_tokenizer: bool = True, model_overrides: dict | None = None,
                         given_model: ModelConfig | None = None) -> InferenceModel:
    """Build this rank's GPT chunk in ``ps``'s layout and fill it from the checkpoint under ``load_dir``.

    The model is the checkpoint's; ``given_model`` (a tool's parsed model flags) may not contradict it: a model
    flag given on the command line that differs from the checkpoint is a ValueError (config/compare.py).

    ``model_overrides``: ModelConfig fields to change that do not touch the weights (e.g.
    ``{"bias_gelu_fusion": False}`` for tracing without the C++ kernels).
    """
    saved = read_saved_config(load_dir, iteration)
    conflict = given_flag_conflicts(saved.model, given_model) if given_model is not None else None
    if conflict is not None:
        raise ValueError(conflict)
    m = saved.model
    if m.num_attention_heads % ps.tp_size or m.num_layers % ps.pp_size:
        raise ValueError(
            f"the checkpoint's {m.num_attention_heads} heads / {m.num_layers} layers do not split over "
            f"--tensor-model-parallel-size {ps.tp_size} / --pipeline-model-parallel-size {ps.pp_size}"
        )
    if ps.ep_size > 1 and (m.num_experts or 1) % ps.ep_size:
        raise ValueError(f"the checkpoint's {m.num_experts or 'no'} experts do not split over "
                         f"--expert-model-parallel-size {ps.ep_size}")
    layers = chunk_layers(m.num_layers, ps.pp_size, ps.pp_rank)
    _, full = load_full_state(load_dir, iteration, layers=layers)  # this stage's layers, not the whole model
    config = copy.deepcopy(saved)
    config.parallel.tensor_model_parallel_size = ps.tp_size
    config.parallel.pipeline_model_parallel_size = ps.pp_size
    config.parallel.expert_model_parallel_size = ps.ep_size
    config.parallel.expert_tensor_parallel_size = ps.etp_size  # the tool's (etp = tp), whatever the saved run used
    config.parallel.num_layers_per_virtual_pipeline_stage = None
    config.parallel.sequence_parallel = False
    config.world_size = ps.world_size
    config.data = tokenizer_overrides(saved.data, cli_data)
    for name, value in (model_overrides or {}).items():
        if not hasattr(config.model, name):
            raise ValueError(f"model_overrides: {name!r} is not a ModelConfig field")
        setattr(config.model, name, value)
    m = config.model
    saved_rows = full["embedding.word_embeddings.weight"].shape[0]
    tokenizer = build_tokenizer_for(config.data, m.vocab_size) if with_tokenizer else None
    if tokenizer is not None:
        vocab_size = min(tokenizer.vocab_size, saved_rows)
    elif m.vocab_size is not None:
        vocab_size = min(m.vocab_size, saved_rows)
    else:
        vocab_size = saved_rows
    eod = tokenizer.eod if tokenizer is not None else None
    if eod is not None and eod >= vocab_size:  # e.g. the null tokenizer's eod just past --vocab-size
        vocab_size = min(eod + 1, saved_rows)
    padded = config.padded_vocab_size(vocab_size)
    chunk = GPTModel(m, ps, vocab_size=padded, seed=config.training.seed, layers=layers,
                     pre_process=ps.is_first_stage, post_process=ps.is_last_stage, dtype=dtype)
    load_into_model([chunk], {k: v.to(dtype) for k, v in full.items()})
    chunk.eval()
    return InferenceModel([chunk], config, tokenizer, vocab_size, eod)
