"""Rotary position embeddings (RoPE, Su et al. 2021), as Megatron-LM and Llama apply them.

Each query and key head rotates pairs of its first ``rotary_dim = head_dim * --rotary-percent``
dimensions by angles ``position * base^(-2i / rotary_dim)``; the pairs are (i, i + rotary_dim / 2)
(the "rotate half" layout of Megatron-LM and Hugging Face Llama, not interleaved neighbours). The other
dimensions pass through. Positions are those of the *full* sequence: attention runs after the QKV
linear has gathered the sequence-parallel shards, and in generation the positions start at the number
of cached tokens.

``apply_rotary`` is the contract the fused kernel meets (``kernels/rotary.py``, which holds the PyTorch
version below the model's floor; the model calls ``fused_apply_rotary``).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from megatron_like.kernels.rotary import apply_rotary_reference as apply_rotary  # noqa: F401 (re-export)


def rotary_cos_sin(positions: torch.Tensor, rotary_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles: ``positions [s]`` (int) -> two float32 ``[s, rotary_dim]``.

    Each frequency appears twice (``cat(freqs, freqs)``) so the tables line up with ``[x1, x2]`` halves.
    """
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=positions.device) / rotary_dim
    inv_freq = 1.0 / (base**exponents)  # (rotary_dim / 2,)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # (s, rotary_dim / 2)
    angles = torch.cat([angles, angles], dim=-1)  # (s, rotary_dim)
    return angles.cos(), angles.sin()


def sequence_rotary_tables(seq_length: int, rotary_dim: int, base: float, device: torch.device
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[seq_length, rotary_dim]`` of positions ``0 .. seq_length - 1``, built once and reused.

    Training and evaluation rotate whole sequences, so every layer of every step needs the same tables:
    rebuilding them is a few tiny ops, each paying a parallel region's start-up (Megatron-LM and Hugging
    Face also build them once per forward). Callers must not write into the returned tensors. Under
    ``torch.compile`` tracing the tables are built in the graph instead (the compiler folds them).
    """
    if torch.compiler.is_compiling():
        return rotary_cos_sin(torch.arange(seq_length, device=device), rotary_dim, base)
    return _cached_tables(seq_length, rotary_dim, float(base), torch.device(device))


@lru_cache(maxsize=16)
def _cached_tables(seq_length: int, rotary_dim: int, base: float, device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    # Normal tensors even when first asked for under torch.inference_mode (evaluation): inference tensors
    # could not be saved for backward by a later training step.
    with torch.inference_mode(False), torch.no_grad():
        return rotary_cos_sin(torch.arange(seq_length, device=device), rotary_dim, base)
