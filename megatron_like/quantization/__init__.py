"""Quantization-aware training: fake int8 quantization of the tensor-parallel linears and int8 export.

``fake_quant.py`` (quantizers, straight-through rounding), ``qat.py`` (QAT and int8 linears, insertion
and conversion), ``export.py`` (QAT checkpoint -> int8 safetensors and back). ``pretrain_gpt.py --qat``
inserts the quantizers; docs/workflows.md shows the whole flow.
"""

from megatron_like.quantization.fake_quant import ActivationFakeQuant, WeightFakeQuant, fake_quant, quantize
from megatron_like.quantization.qat import convert_to_int8, insert_fake_quant, int8_matmul

__all__ = [
    "ActivationFakeQuant",
    "WeightFakeQuant",
    "convert_to_int8",
    "fake_quant",
    "insert_fake_quant",
    "int8_matmul",
    "quantize",
]
