"""Rotary position embeddings (RoPE, Su et al. 2021), as Megatron-LM and Llama apply them.

Each query and key head rotates pairs of its first ``rotary_dim = head_dim * --rotary-percent``
dimensions by angles ``position * base^(-2i / rotary_dim)``; the pairs are (i, i + rotary_dim / 2)
(the "rotate half" layout of Megatron-LM and Hugging Face Llama, not interleaved neighbours). The other
dimensions pass through. RoPE scaling (:class:`RopeScaling`: Llama 3.1's "llama3", the "linear"
position interpolation and YaRN) changes those inverse frequencies, in :func:`rotary_inv_freq`, and (YaRN
only) multiplies the tables by its attention factor, in :func:`rotary_cos_sin`: the one place the tables are
built from; training, generation's KV cache and the fused kernel all read the tables.

Positions are those of the *full* sequence: attention runs after the QKV linear has gathered the
sequence-parallel shards, and in generation the positions start at the number of cached tokens.

``apply_rotary`` is the contract the fused kernel meets (``kernels/rotary.py``, which holds the PyTorch
version below the model's floor; the model calls ``fused_apply_rotary``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Literal

import torch

from megatron_like.kernels.rotary import apply_rotary_reference as apply_rotary  # noqa: F401 (re-export)

if TYPE_CHECKING:
    from megatron_like.config import ModelConfig


@dataclass(frozen=True)
class RopeScaling:
    """How the rotary frequencies are rescaled for contexts longer than pretraining's (Hugging Face's
    ``rope_scaling`` types of the same names).

    * ``linear`` (``--rotary-seq-len-interpolation-factor``): position interpolation, every angle divided by
      ``factor`` (positions ``t / factor``; Llama 2 long-context fine-tunes).
    * ``llama3`` (``--use-rope-scaling``): Llama 3.1's: frequencies whose wavelength ``2 pi / inv_freq`` exceeds
      ``original_max_positions / low_freq_factor`` are divided by ``factor``, those shorter than
      ``original_max_positions / high_freq_factor`` are kept, and those between interpolate smoothly.
    * ``yarn`` (``--rope-type yarn``, DeepSeek-V2/V3): frequencies that turn more than ``beta_fast`` times over
      ``original_max_positions`` are kept, those turning fewer than ``beta_slow`` times are divided by
      ``factor``, a linear ramp over the dimensions between; the tables are multiplied by
      ``m(mscale) / m(mscale_all_dim)`` (:attr:`table_scale`), ``m(x) = 0.1 x ln(factor) + 1``.
    """

    kind: Literal["linear", "llama3", "yarn"]
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    def apply(self, inv_freq: torch.Tensor, base: float) -> torch.Tensor:
        """Rescaled inverse frequencies ``[rotary_dim / 2]`` (float32, as Hugging Face computes them)."""
        if self.kind == "linear":
            return inv_freq / self.factor
        if self.kind == "yarn":
            return self.yarn_inv_freq(inv_freq, base)
        wavelength = 2 * math.pi / inv_freq
        long_wavelength = self.original_max_positions / self.low_freq_factor  # longer: divide by factor
        short_wavelength = self.original_max_positions / self.high_freq_factor  # shorter: keep
        smooth = (self.original_max_positions / wavelength - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor)  # 0 at long_wavelength, 1 at short_wavelength
        interpolated = (1 - smooth) * inv_freq / self.factor + smooth * inv_freq
        scaled = torch.where(wavelength > long_wavelength, inv_freq / self.factor, inv_freq)
        between = (wavelength >= short_wavelength) & (wavelength <= long_wavelength)
        return torch.where(between, interpolated, scaled)

    def yarn_inv_freq(self, inv_freq: torch.Tensor, base: float) -> torch.Tensor:
        """YaRN's blend of the kept (``inv_freq``) and interpolated (``inv_freq / factor``) frequencies."""
        half = inv_freq.numel()
        dim = 2 * half

        def dimension_turning(turns: float) -> float:  # the pair index whose frequency turns `turns` times
            return dim * math.log(self.original_max_positions / (turns * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(dimension_turning(self.beta_fast)), 0)
        high = min(math.ceil(dimension_turning(self.beta_slow)), dim - 1)
        if low == high:
            high += 0.001  # a ramp of zero width would divide by zero
        ramp = ((torch.arange(half, dtype=torch.float32, device=inv_freq.device) - low) / (high - low)).clamp(0, 1)
        return inv_freq / self.factor * ramp + inv_freq * (1 - ramp)  # ramp 0: fast pairs kept, 1: interpolated

    @property
    def table_scale(self) -> float:
        """What the cos and sin tables are multiplied by (YaRN's attention factor on the rotated slice; else 1)."""
        if self.kind != "yarn":
            return 1.0
        return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)

    @property
    def softmax_scale_factor(self) -> float:
        """What the attention's ``1 / sqrt(d)`` is multiplied by: ``m(mscale_all_dim)^2`` for YaRN, else 1."""
        if self.kind != "yarn" or not self.mscale_all_dim:
            return 1.0
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention factor ``0.1 mscale ln(factor) + 1`` (1 without extension)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_scaling_of(config: ModelConfig) -> RopeScaling | None:
    """The :class:`RopeScaling` a ``ModelConfig``'s flags ask for (None: plain RoPE)."""
    if config.rope_type == "yarn":
        return RopeScaling("yarn", config.rotary_scaling_factor, original_max_positions=
                           config.original_max_position_embeddings, beta_fast=config.beta_fast,
                           beta_slow=config.beta_slow, mscale=config.mscale, mscale_all_dim=config.mscale_all_dim)
    if config.use_rope_scaling:
        return RopeScaling("llama3", config.rope_scaling_factor, config.rope_scaling_low_freq_factor,
                           config.rope_scaling_high_freq_factor, config.rope_scaling_original_max_position_embeddings)
    if config.rotary_seq_len_interpolation_factor is not None:
        return RopeScaling("linear", float(config.rotary_seq_len_interpolation_factor))
    return None


def rotary_inv_freq(rotary_dim: int, base: float, scaling: RopeScaling | None = None,
                    device: torch.device | None = None) -> torch.Tensor:
    """Inverse frequencies ``base^(-2i / rotary_dim)``, ``i < rotary_dim / 2`` (float32), rescaled by ``scaling``."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim
    inv_freq = 1.0 / (base**exponents)  # (rotary_dim / 2,)
    return inv_freq if scaling is None else scaling.apply(inv_freq, base)


def rotary_cos_sin(positions: torch.Tensor, rotary_dim: int, base: float, scaling: RopeScaling | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles: ``positions [s]`` (int) -> two float32 ``[s, rotary_dim]``.

    Each frequency appears twice (``cat(freqs, freqs)``) so the tables line up with ``[x1, x2]`` halves.
    """
    inv_freq = rotary_inv_freq(rotary_dim, base, scaling, positions.device)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # (s, rotary_dim / 2)
    angles = torch.cat([angles, angles], dim=-1)  # (s, rotary_dim)
    scale = 1.0 if scaling is None else scaling.table_scale
    if scale != 1.0:
        return angles.cos() * scale, angles.sin() * scale
    return angles.cos(), angles.sin()


def sequence_rotary_tables(seq_length: int, rotary_dim: int, base: float, device: torch.device,
                           scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[seq_length, rotary_dim]`` of positions ``0 .. seq_length - 1``, built once and reused.

    Training and evaluation rotate whole sequences, so every layer of every step needs the same tables:
    rebuilding them is a few tiny ops, each paying a parallel region's start-up (Megatron-LM and Hugging
    Face also build them once per forward). Callers must not write into the returned tensors. Under
    ``torch.compile`` tracing the tables are built in the graph instead (the compiler folds them).
    """
    if torch.compiler.is_compiling():
        return rotary_cos_sin(torch.arange(seq_length, device=device), rotary_dim, base, scaling)
    return _cached_tables(seq_length, rotary_dim, float(base), torch.device(device), scaling)


@lru_cache(maxsize=16)
def _cached_tables(seq_length: int, rotary_dim: int, base: float, device: torch.device,
                   scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    # Normal tensors even when first asked for under torch.inference_mode (evaluation): inference tensors
    # could not be saved for backward by a later training step.
    with torch.inference_mode(False), torch.no_grad():
        return rotary_cos_sin(torch.arange(seq_length, device=device), rotary_dim, base, scaling)
