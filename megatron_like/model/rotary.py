"""Rotary position embeddings (RoPE, Su et al. 2021), as Megatron-LM and Llama apply them.

Each query and key head rotates pairs of its first ``rotary_dim = head_dim * --rotary-percent``
dimensions by angles ``position * base^(-2i / rotary_dim)``; the pairs are (i, i + rotary_dim / 2)
(the "rotate half" layout of Megatron-LM and Hugging Face Llama, not interleaved neighbours). The other
dimensions pass through. Positions are those of the *full* sequence: attention runs after the QKV
linear has gathered the sequence-parallel shards, and in generation the positions start at the number
of cached tokens.

``apply_rotary`` is the one function a fused kernel replaces: same arguments, same result.
"""

from __future__ import annotations

import torch


def rotary_cos_sin(positions: torch.Tensor, rotary_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles: ``positions [s]`` (int) -> two float32 ``[s, rotary_dim]``.

    Each frequency appears twice (``cat(freqs, freqs)``) so the tables line up with ``[x1, x2]`` halves.
    """
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=positions.device) / rotary_dim
    inv_freq = 1.0 / (base**exponents)  # (rotary_dim / 2,)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # (s, rotary_dim / 2)
    angles = torch.cat([angles, angles], dim=-1)  # (s, rotary_dim)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [b, heads, s, head_dim]`` by ``cos, sin [s, rotary_dim]``; same shape and dtype as ``x``.

    ``x[..., :rotary_dim]`` becomes ``x * cos + rotate_half(x) * sin`` with ``rotate_half([x1, x2]) =
    [-x2, x1]``; ``x[..., rotary_dim:]`` is unchanged. The tables are cast to ``x``'s dtype first (as
    Megatron-LM), so 16-bit runs rotate in 16-bit.
    """
    rotary_dim = cos.shape[-1]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    rotated, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    x1, x2 = rotated.chunk(2, dim=-1)
    rotated = rotated * cos + torch.cat([-x2, x1], dim=-1) * sin
    return torch.cat([rotated, passed], dim=-1) if passed.shape[-1] else rotated
