"""Tiny models and the greedy-token check shared by the generation and QAT tests on CUDA."""

from __future__ import annotations

import torch

from megatron_like.config import ModelConfig
from megatron_like.model import GPTModel
from megatron_like.parallel_state import ParallelState

VOCAB, PADDED = 60, 64
PROMPTS = [[1, 2, 3, 4, 5, 6], [7, 8], [9]]
LLAMA = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, group_query_attention=True,
             num_query_groups=2, disable_bias_linear=True, rotary_percent=0.5)
MODELS = {"gpt": {}, "llama": LLAMA}
MARGIN = 1e-3
"""How far below the CPU's best logit a generated token's logit may be (float32 noise is ~1e-6)."""


def tiny(ps: ParallelState, **overrides) -> GPTModel:
    config = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64, hidden_dropout=0.0,
                         attention_dropout=0.0, vocab_size=VOCAB, init_method_std=0.2, **overrides)
    return GPTModel(config, ps, vocab_size=PADDED, seed=3).eval()


def assert_greedy_on(model: GPTModel, prompt: list[int], new_tokens: list[int]) -> None:
    """Each of ``new_tokens`` is ``model``'s best next token after its prefix (teacher forced), up to MARGIN.

    A near tie between two tokens cannot fail the check, while a wrong decode step (cache position, rotary
    offset, kernel) picks tokens far from the best.
    """
    sequence = torch.tensor([prompt + new_tokens], device=next(model.parameters()).device)
    with torch.no_grad():
        logits = model(sequence, torch.arange(sequence.shape[1], device=sequence.device)[None])[0, :, :VOCAB].float()
    for step, token in enumerate(new_tokens):
        row = logits[len(prompt) - 1 + step]
        assert row[token] >= row.max() - MARGIN, f"step {step}: token {token} is {row.max() - row[token]:.3g} " \
                                                 f"below the best ({int(row.argmax())})"
