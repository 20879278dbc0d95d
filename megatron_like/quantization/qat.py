"""Insert fake quantization into a model's tensor-parallel linears, and turn them into int8 linears.

:func:`insert_fake_quant` makes every ``ColumnParallelLinear``/``RowParallelLinear`` of the transformer
layers (``layers.*``: attention qkv/proj, MLP fc1/fc2) a QAT linear: the same object, parameters and
names, whose forward fake-quantizes its input (per tensor, moving average) and its weight (per output
channel). Run it in the model provider, before data parallelism wraps the parameters. The embedding and
the (tied) output layer stay in float, as is usual for int8 LMs.

:func:`convert_to_int8` replaces each QAT linear's float weight by int8 codes with per-channel scales
and a frozen input scale; its forward quantizes the input, multiplies int8 by int8 into exact int32 sums
(:func:`exact_int8_mm`), and rescales: ``y = (q(x) @ q(W)^T) * s_x * s_W + b``, the fake-quant model's
arithmetic with exact integer accumulation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_like.parallel_state import ParallelState
from megatron_like.quantization.fake_quant import ActivationFakeQuant, WeightFakeQuant, quantize
from megatron_like.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
)
from megatron_like.tensor_parallel.mappings import copy_to_tensor_parallel_region, gather_from_sequence_parallel_region

MOVING_RATE = 0.9
"""Weight of the old activation range in the moving average (PaddleSlim's moving_average_abs_max)."""


class QATColumnParallelLinear(ColumnParallelLinear):
    """ColumnParallelLinear computing with fake-quantized input and weight (see the module docstring)."""

    input_quantizer: ActivationFakeQuant
    weight_quantizer: WeightFakeQuant

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        weight = self.weight if weight is None else weight
        # Rounding is elementwise with a tp-wide scale, so it commutes with the sequence gather inside.
        return super().forward(self.input_quantizer(x), weight=self.weight_quantizer(weight))


class QATRowParallelLinear(RowParallelLinear):
    """RowParallelLinear computing with fake-quantized input and weight (its forward, with the quantizers)."""

    input_quantizer: ActivationFakeQuant
    weight_quantizer: WeightFakeQuant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, self.tp_group)
        partial = F.linear(self.input_quantizer(x), self.weight_quantizer(self.weight))
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)
        else:
            y = reduce_from_tensor_parallel_region(partial, self.tp_group)
        return y if self.bias is None else y + self.bias


QAT_CLASSES = {ColumnParallelLinear: QATColumnParallelLinear, RowParallelLinear: QATRowParallelLinear}


def quantizable_linears(model: nn.Module) -> dict[str, nn.Module]:
    """``{name: module}`` of the tensor-parallel linears inside ``layers.*`` (float or already QAT/int8)."""
    return {name: module for name, module in model.named_modules()
            if name.startswith("layers.") and isinstance(module, (ColumnParallelLinear, RowParallelLinear))}


def insert_fake_quant(model: nn.Module, ps: ParallelState, moving_rate: float = MOVING_RATE) -> list[str]:
    """Turn the transformer linears of ``model`` (a chunk) into QAT linears in place; return their names."""
    names = []
    for name, module in quantizable_linears(model).items():
        if type(module) not in QAT_CLASSES:
            continue  # already quantized
        row = isinstance(module, RowParallelLinear)
        input_sharded = row or module.sequence_parallel
        module.__class__ = QAT_CLASSES[type(module)]
        module.input_quantizer = ActivationFakeQuant(moving_rate, ps.tp_group if input_sharded else None, ps.device)
        module.weight_quantizer = WeightFakeQuant(ps.tp_group if row else None)
        names.append(name)
    return names


# --------------------------------------------------------------------------------------------------
# int8 inference
# --------------------------------------------------------------------------------------------------


# Every sum of up to 1024 products of int8 codes in [-127, 127] is an integer below 2^24, which float32 holds
# exactly in any summation order.
_EXACT_FP32_CHUNK = 1024

INT_MM_MIN_ROWS = 17
"""``torch._int_mm`` on CUDA (cuBLASLt) refuses a left operand of 16 rows or fewer, e.g. a decode step's."""
INT_MM_MULTIPLE = 8
"""``torch._int_mm`` on CUDA also needs the inner and output sizes to be positive multiples of 8."""


def int_mm_shape(m: int, k: int, n: int) -> tuple[int, int, int]:
    """Return the smallest ``(rows, inner, cols) >= (m, k, n)`` that ``torch._int_mm`` accepts on CUDA.

    Zero rows and columns add nothing to any product, so padding to this shape and slicing back is exact.
    """

    def round_up(size: int) -> int:
        return max(INT_MM_MULTIPLE, -(-size // INT_MM_MULTIPLE) * INT_MM_MULTIPLE)

    return max(m, INT_MM_MIN_ROWS), round_up(k), round_up(n)


def padded_int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [m, k]`` int8 times ``b [k, n]`` int8 -> exact int32 ``[m, n]`` by ``torch._int_mm`` at any shape.

    Operands are zero-padded to :func:`int_mm_shape` when they miss its rules (a decode step's few rows:
    a copy of ``x``; a weight whose sizes are not multiples of 8: a copy of the weight on every call).
    ``b`` is padded in its transposed layout, so a ``weight.t()`` view stays column-major as cuBLASLt likes.
    """
    m, k = a.shape
    n = b.shape[1]
    rows, inner, cols = int_mm_shape(m, k, n)
    if (rows, inner) != (m, k):
        a = F.pad(a, (0, inner - k, 0, rows - m))
    if (inner, cols) != (k, n):
        b = F.pad(b.t(), (0, inner - k, 0, cols - n)).t()
    return torch._int_mm(a, b)[:m, :n]


def exact_int8_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [m, k]`` int8 times ``b [k, n]`` int8 -> exact int32 ``[m, n]``.

    On CPU, ``torch._int_mm`` is not exact everywhere: oneDNN's int8 GEMM on a CPU without AVX-512 VNNI
    (AVX2) multiplies through ``vpmaddubsw``, whose int16 pair sums saturate (an error of 22261 on random
    codes of a 15x16 @ 16x8 product). So the CPU path runs float32 GEMMs over chunks of 1024 along ``k`` (each
    exact, see above) and sums the chunks in int32. Elsewhere (CUDA) ``torch._int_mm`` accumulates in int32,
    on operands padded to the shapes it accepts (:func:`padded_int_mm`).
    """
    if a.device.type != "cpu":
        return padded_int_mm(a, b)
    out = torch.zeros(a.shape[0], b.shape[1], dtype=torch.int32, device=a.device)
    for start in range(0, a.shape[1], _EXACT_FP32_CHUNK):
        stop = start + _EXACT_FP32_CHUNK
        out += (a[:, start:stop].float() @ b[start:stop].float()).to(torch.int32)
    return out


def int8_matmul(x: torch.Tensor, weight_int8: torch.Tensor, weight_scale: torch.Tensor,
                input_scale: torch.Tensor) -> torch.Tensor:
    """``x [..., in]`` (float) times int8 ``weight [out, in]``: quantize x, int32 accumulate, rescale.

    ``weight_scale`` is ``[out]``, ``input_scale`` a scalar. Returns float32 ``[..., out]`` (no bias).
    """
    shape = x.shape
    x_int8 = quantize(x.reshape(-1, shape[-1]), input_scale)
    accumulated = exact_int8_mm(x_int8, weight_int8.t())  # (tokens, out) int32
    y = accumulated.float() * (input_scale.float() * weight_scale.float())
    return y.reshape(*shape[:-1], weight_int8.shape[0])


class Int8Linear:
    """Shared part of the int8 linears: buffers ``weight_int8 [out, in]``, ``weight_scale [out]``, ``input_scale``."""

    def to_int8(self) -> None:
        """Freeze this QAT linear: int8 codes and scales replace the float weight."""
        weight = self.weight.detach()
        weight_scale = self.weight_quantizer.scale(weight)  # (out, 1), tp-wide for row-parallel
        self.register_buffer("weight_int8", quantize(weight, weight_scale))
        self.register_buffer("weight_scale", weight_scale.reshape(-1).float())
        self.register_buffer("input_scale", self.input_quantizer.scale().detach().clone())
        del self.weight
        del self.input_quantizer
        del self.weight_quantizer

    def int8_forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_matmul(x, self.weight_int8, self.weight_scale, self.input_scale).to(x.dtype)


class Int8ColumnParallelLinear(Int8Linear, ColumnParallelLinear):
    """ColumnParallelLinear with int8 weights: ``[s, b, in]`` -> ``[s, b, out / tp]``."""

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.tp_group, grad_is_partial=True)
        else:
            x = copy_to_tensor_parallel_region(x, self.tp_group)
        y = self.int8_forward(x)
        return y if self.bias is None or getattr(self, "skip_bias_add", False) else y + self.bias


class Int8RowParallelLinear(Int8Linear, RowParallelLinear):
    """RowParallelLinear with int8 weights: ``[s, b, in / tp]`` -> ``[s, b, out]``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, self.tp_group)
        partial = self.int8_forward(x)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)
        else:
            y = reduce_from_tensor_parallel_region(partial, self.tp_group)
        return y if self.bias is None else y + self.bias


INT8_CLASSES = {QATColumnParallelLinear: Int8ColumnParallelLinear, QATRowParallelLinear: Int8RowParallelLinear}


def convert_to_int8(model: nn.Module) -> list[str]:
    """Replace every QAT linear of ``model`` by its int8 twin in place (inference only); return their names."""
    names = []
    for name, module in quantizable_linears(model).items():
        if type(module) not in INT8_CLASSES:
            continue
        module.__class__ = INT8_CLASSES[type(module)]
        module.to_int8()
        names.append(name)
    return names
