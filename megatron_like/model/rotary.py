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
