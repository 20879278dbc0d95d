"""Fake int8 quantization for quantization-aware training (QAT) of our tensor-parallel linears.

``fake_quant(x, scale) = clamp(round(x / scale), -127, 127) * scale``: the forward sees exactly the values
an int8 model computes with; the backward is the straight-through estimator (the gradient passes as if
the rounding were the identity). Two quantizers, as FleetX's QAT configs:

* :class:`WeightFakeQuant`: symmetric, per output channel: ``scale[o] = max_i |W[o, i]| / 127``;
* :class:`ActivationFakeQuant`: symmetric, per tensor, with a moving-average range: during training
  ``amax <- rate * amax + (1 - rate) * max |x|`` (the first batch sets it), in eval the stored ``amax``.

Tensor parallelism: a quantizer whose tensor is a tp shard (the row-parallel input and weight rows, a
sequence-parallel input) takes the max over the tp group, so every tp layout quantizes exactly as one
process does. Data-parallel replicas keep their own activation ranges (like BatchNorm statistics); the
checkpoint stores data-parallel rank 0's.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron_like import collectives as comm
from megatron_like.collectives import Group

QMAX = 127
"""Largest int8 magnitude used: symmetric range [-127, 127] (-128 unused, so 0 is exact and signs balance)."""
EPS = 1e-8
"""Smallest range: an all-zero tensor quantizes to zeros with a finite scale."""


class _FakeQuantSTE(torch.autograd.Function):
    """Forward: round to the int8 grid of ``scale``. Backward: identity (straight-through)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return torch.clamp(torch.round(x / scale), -QMAX, QMAX) * scale

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def fake_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to the symmetric int8 grid of ``scale`` (broadcastable to ``x``), straight-through grads."""
    return _FakeQuantSTE.apply(x, scale.to(x.dtype))


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The int8 codes of ``x`` on the grid of ``scale``: int8 tensor of ``x``'s shape."""
    return torch.clamp(torch.round(x.float() / scale.float()), -QMAX, QMAX).to(torch.int8)


class WeightFakeQuant(nn.Module):
    """Per-output-channel symmetric fake quantization of a weight ``[out, in]`` (no state).

    ``tp_group`` is given when the weight holds a slice of each row (row-parallel): the row maxima are
    then reduced over tp, so the scale is the full row's.
    """

    def __init__(self, tp_group: Group = None) -> None:
        super().__init__()
        self.tp_group = tp_group

    def scale(self, weight: torch.Tensor) -> torch.Tensor:
        """``[out, 1]`` float32 scales: max |row| / 127."""
        amax = weight.detach().abs().amax(dim=1, keepdim=True).float()
        if self.tp_group is not None:
            comm.all_reduce(amax, self.tp_group, op="max")
        return amax.clamp(min=EPS) / QMAX

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return fake_quant(weight, self.scale(weight))


class ActivationFakeQuant(nn.Module):
    """Per-tensor symmetric fake quantization with a moving-average range (buffer ``amax``, float32 scalar).

    ``tp_group`` is given when the input is a tp shard (its max is reduced over tp). Loading a checkpoint
    without ``amax`` (a float model starting QAT) leaves the range unset: the first training batch sets it.
    """

    def __init__(self, moving_rate: float = 0.9, tp_group: Group = None, device: torch.device | None = None) -> None:
        super().__init__()
        self.moving_rate, self.tp_group = moving_rate, tp_group
        # On the activations' device: the range is updated in place from each batch's (device) maximum.
        self.register_buffer("amax", torch.zeros((), device=device))
        self.register_buffer("initialized", torch.zeros((), dtype=torch.bool, device=device))

    def current_amax(self, x: torch.Tensor) -> torch.Tensor:
        amax = x.detach().abs().amax().float().reshape(1)
        if self.tp_group is not None:
            comm.all_reduce(amax, self.tp_group, op="max")
        return amax[0]

    def scale(self) -> torch.Tensor:
        """The float32 scalar scale of the stored range: amax / 127."""
        return self.amax.clamp(min=EPS) / QMAX

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            current = self.current_amax(x)
            if bool(self.initialized):
                self.amax.mul_(self.moving_rate).add_((1 - self.moving_rate) * current)
            else:
                self.amax.copy_(current)
                self.initialized.fill_(True)
        elif not bool(self.initialized):
            return fake_quant(x, self.current_amax(x).clamp(min=EPS) / QMAX)  # no range yet: this batch's
        return fake_quant(x, self.scale())

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        if prefix + "amax" not in state_dict:  # a float checkpoint: keep the range unset, report nothing missing
            return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
