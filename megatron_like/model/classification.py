"""GPT with a sequence-classification head (Hugging Face's ``GPT2ForSequenceClassification`` in our blocks).

The body is GPT's: the same embedding, causal layers and final LayerNorm under the same parameter names,
so a pretrained GPT checkpoint of any (tp, pp) layout loads into it (:func:`load_pretrained_gpt`). The
language-model output layer is replaced by ``head``: ``h -> num_classes`` without bias, applied to the
final hidden state of each sequence's last real token (causal attention: it has seen the whole pair).

One ``GPTClassificationModel`` is one pipeline chunk: the first chunk owns the embedding, the last the
final LayerNorm and the head. It shares no weight between stages (no tied output layer).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from megatron_like.config import ModelConfig
from megatron_like.model.gpt import GPTEmbedding
from megatron_like.model.norms import build_norm
from megatron_like.model.state import chunk_state, load_full_state
from megatron_like.model.transformer import TransformerLayer, forward_layers
from megatron_like.model.vit import replicated_parameter
from megatron_like.parallel_state import ParallelState
from megatron_like.tensor_parallel import gather_from_sequence_parallel_region, load_initial_values


class GPTClassificationModel(nn.Module):
    """A chunk of GPT for classification: [embedding] -> layers -> [final LayerNorm -> head on last token].

    Args:
        vocab_size: the padded vocabulary (a multiple of tp).
        num_classes: outputs of the head.
        layers: global indices of the transformer layers this chunk holds.
        pre_process: this chunk takes token ids (first pipeline stage).
        post_process: this chunk produces the logits (last pipeline stage).
    """

    def __init__(self, config: ModelConfig, ps: ParallelState, *, vocab_size: int, num_classes: int, seed: int,
                 layers: range | None = None, pre_process: bool = True, post_process: bool = True,
                 sequence_parallel: bool = False, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        layers = range(config.num_layers) if layers is None else layers
        self.config, self.ps = config, ps
        self.pre_process, self.post_process = pre_process, post_process
        self.sequence_parallel = sequence_parallel
        self.vocab_size, self.num_classes = vocab_size, num_classes
        self.input_tensor: torch.Tensor | None = None
        if pre_process:
            self.embedding = GPTEmbedding(config, ps, vocab_size, seed, sequence_parallel, dtype)
        self.layers = nn.ModuleList(
            TransformerLayer(config, ps, layer, seed, sequence_parallel, dtype) for layer in layers
        )
        if post_process:
            self.final_layernorm = build_norm(config, sequence_parallel, dtype, ps.device)
            self.head_weight = replicated_parameter((num_classes, config.hidden_size), config.init_method_std, seed,
                                                    "classification_head.weight", dtype, ps.device)

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        """Hidden states ``[s, b, h]`` received from the previous pipeline stage."""
        self.input_tensor = tensor

    def forward(self, input_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                last_index: torch.Tensor | None = None, hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        """Run this chunk.

        Args:
            input_ids, position_ids: ``[b, s]`` (first chunk only).
            last_index: ``[b]`` position of each sequence's last real token (last chunk only).
            hidden_states: ``[s, b, h]`` (``[s / tp, b, h]`` with sequence parallelism) from the previous
                stage; defaults to the tensor given to ``set_input_tensor``.
        Returns:
            logits ``[b, num_classes]`` on the last chunk, the hidden states for the next stage elsewhere.
        """
        if self.pre_process:
            hidden_states = self.embedding(input_ids, position_ids)
        elif hidden_states is None:
            hidden_states = self.input_tensor
        if hidden_states is None:
            raise ValueError("a chunk without the embedding needs hidden_states from the previous stage")
        hidden_states = forward_layers(self.layers, hidden_states, self.config)
        if not self.post_process:
            return hidden_states
        if last_index is None:
            raise ValueError("the last chunk needs last_index [b] to pick each sequence's last token")
        hidden_states = self.final_layernorm(hidden_states)
        if self.sequence_parallel:
            # Every tp rank computes the replicated head on the full sequence: keep own gradient slice.
            hidden_states = gather_from_sequence_parallel_region(hidden_states, self.ps.tp_group,
                                                                 grad_is_partial=False)  # (s, b, h)
        batch = torch.arange(hidden_states.shape[1], device=hidden_states.device)
        pooled = hidden_states[last_index, batch]  # (b, h)
        return F.linear(pooled, self.head_weight)  # (b, num_classes)


PRETRAINED_SHAPE = ("num_layers", "hidden_size", "num_attention_heads", "head_dim", "qk_layernorm", "ffn_size",
                    "max_positions")
"""ModelConfig fields a pretrained GPT checkpoint must share with the classification model that loads it."""


def pretrained_shape_mismatch(saved: ModelConfig, model: ModelConfig, root: str) -> str | None:
    """One line naming the first :data:`PRETRAINED_SHAPE` field where checkpoint ``root`` (saved with ``saved``)
    differs from ``model``, with the fix; None when every field matches."""
    for name in PRETRAINED_SHAPE:
        if getattr(saved, name) != getattr(model, name):
            return (f"pretrained checkpoint {root} has {name} {getattr(saved, name)}, this model "
                    f"{getattr(model, name)}; pass the checkpoint's model flags")
    return None


@functools.lru_cache(maxsize=2)
def _cached_full_state(root: str) -> tuple[object, dict[str, torch.Tensor]]:
    return load_full_state(root)


def load_pretrained_gpt(chunk: GPTClassificationModel, root: str) -> list[str]:
    """Copy a GPT checkpoint (``pretrain_gpt.py --save``, any tp/pp layout) into ``chunk``'s GPT body.

    The embedding rows are trimmed or zero-padded to this model's padded vocabulary; the LM output layer
    is not used. Returns the names left at their initial values (the head), so callers can report them.
    The checkpoint's shape must match ``chunk.config`` (layers, hidden size, heads).
    """
    saved, full = _cached_full_state(root)
    m = saved.model
    problem = pretrained_shape_mismatch(m, chunk.config, root)
    if problem:
        raise ValueError(problem)
    ps = chunk.ps
    layers = range(chunk.layers[0].layer, chunk.layers[-1].layer + 1) if len(chunk.layers) else range(0)
    body = {k: v for k, v in full.items() if not k.startswith("output_layer.")}
    state = chunk_state(body, m, layers=layers, pre_process=chunk.pre_process, post_process=chunk.post_process,
                        tp_size=ps.tp_size, tp_rank=ps.tp_rank, padded_vocab_size=chunk.vocab_size)
    state = {k: v.to(next(chunk.parameters()).dtype) for k, v in state.items() if not k.startswith("output_layer.")}
    # Also before ZeRO-3 has drawn the deferred parameters: they then take these values when drawn.
    missing, unexpected = load_initial_values(chunk, state)
    if unexpected:
        raise ValueError(f"pretrained checkpoint {root} holds parameters this model lacks: {unexpected}")
    body_missing = [name for name in missing if name != "head_weight"]
    if body_missing:
        raise ValueError(f"pretrained checkpoint {root} lacks {body_missing}")
    return list(missing)
