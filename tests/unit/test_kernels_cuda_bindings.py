"""Every kernel wrapper's CUDA branch calls only what its ``csrc/cuda/<op>.cu`` binds, on any machine.

For each ``.cu`` file a stand-in extension is built from its ``PYBIND11_MODULE`` block: one attribute per
``m.def(...)``, which checks the argument count and kinds against the C++ signature (as pybind11 would)
and records the call, and nothing else (no ``set_isa``, unlike the CPU modules). It is imported through
the real loader as ``megatron_like._csrc.cuda_<op>``, CPU tensors are made to look like CUDA ones
(``_common.device_type_of``), and each public op runs forward and backward. A wrapper calling a binding
the ``.cu`` lacks, with the wrong arguments, a loader that expects an ISA switch, or a wrapper that
silently falls back to PyTorch fails here. The numbers are not checked (nothing runs a kernel):
tests/gpu does that on a GPU; tests/unit/test_cuda_compile.py compiles the sources with nvcc.
"""

from __future__ import annotations

import re
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from megatron_like.kernels import (
    _common,
    _loader,
    bias_gelu,
    fused_add_layer_norm,
    fused_apply_rotary,
    fused_rms_norm,
    fused_swiglu,
    fused_vocab_cross_entropy,
    grouped_gemm,
    layer_norm,
    scaled_masked_softmax,
    scaled_upper_triang_masked_softmax,
)

CUDA_DIR = Path(__file__).resolve().parents[2] / "csrc" / "cuda"
STREAM = 0x5EED
"""The stream handle the stand-in device reports; every binding must receive it as its last argument."""


def declared_bindings(source: Path) -> dict[str, list[str]]:
    """Return ``{binding name: [C++ parameter type, ...]}`` of the ``PYBIND11_MODULE`` block of a ``.cu`` file."""
    text = source.read_text()
    block = re.search(r"PYBIND11_MODULE\(\s*ML_CUDA_MODULE\s*,\s*m\s*\)\s*\{(.*?)\n\}", text, re.S)
    assert block, f"{source.name}: no PYBIND11_MODULE(ML_CUDA_MODULE, m) block"
    bindings = {}
    for name, function in re.findall(r'm\.def\(\s*"(\w+)"\s*,\s*&ml_cuda::(\w+)', block.group(1)):
        signature = re.search(rf"\bvoid\s+{function}\s*\(([^)]*)\)\s*\{{", text)
        assert signature, f"{source.name}: binding {name!r} -> ml_cuda::{function}, whose definition is not in the file"
        bindings[name] = [" ".join(param.split()[:-1]) for param in signature.group(1).split(",")]
    assert bindings, f"{source.name}: PYBIND11_MODULE binds nothing"
    return bindings


def _accepts(cpp_type: str, value: object) -> bool:
    """Whether pybind11 would convert ``value`` to a parameter of ``cpp_type`` (the types the twins use)."""
    if cpp_type == "double":
        return isinstance(value, (int, float))
    if cpp_type == "bool":
        return isinstance(value, (bool, int))
    if cpp_type in ("std::uintptr_t", "std::int64_t", "int"):
        return isinstance(value, int) and not (cpp_type == "std::uintptr_t" and value < 0)
    raise AssertionError(f"the stand-in does not know the C++ type {cpp_type!r}: teach _accepts")


@dataclass
class StandIn:
    """A fake ``megatron_like._csrc.cuda_<op>`` and the names of the bindings called on it."""

    module: types.ModuleType
    calls: list[str] = field(default_factory=list)


def stand_in(op: str) -> StandIn:
    """Build the stand-in extension for ``csrc/cuda/<op>.cu`` (exactly its bindings)."""
    stub = StandIn(types.ModuleType(f"megatron_like._csrc.{_loader.CUDA_MODULE_PREFIX}{op}"))
    for name, params in declared_bindings(CUDA_DIR / f"{op}.cu").items():

        def binding(*args, _name=name, _params=params):
            where = f"{op}.{_name}"
            assert len(args) == len(_params), f"{where} takes {len(_params)} arguments, the wrapper passed {len(args)}"
            for i, (cpp_type, value) in enumerate(zip(_params, args)):
                assert _accepts(cpp_type, value), f"{where} argument {i} is {cpp_type}, the wrapper passed {value!r}"
            assert args[-1] == STREAM, f"{where}: the last argument must be the current CUDA stream"
            stub.calls.append(_name)

        setattr(stub.module, name, binding)
    return stub


@pytest.fixture
def cuda_twins(monkeypatch: pytest.MonkeyPatch) -> dict[str, StandIn]:
    """Install a stand-in for every ``.cu`` file and make every tensor look like a CUDA tensor."""
    monkeypatch.delenv(_loader.NO_CSRC_ENV, raising=False)
    _loader.refresh_environment()
    monkeypatch.setattr(_loader, "_cache", {})
    twins = {}
    for source in sorted(CUDA_DIR.glob("*.cu")):
        twins[source.stem] = stand_in(source.stem)
        monkeypatch.setitem(sys.modules, twins[source.stem].module.__name__, twins[source.stem].module)
    monkeypatch.setattr(_common, "device_type_of", lambda tensor: "cuda")
    monkeypatch.setattr(_common, "cuda_stream_handle", lambda device: STREAM)
    return twins


def _leaf(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape).to(dtype).requires_grad_()


def _backward(*outputs: torch.Tensor) -> None:
    torch.autograd.backward([o for o in outputs], [torch.ones_like(o) for o in outputs])


def _bias_gelu(dtype):
    _backward(bias_gelu(_leaf(3, 8, dtype=dtype), _leaf(8, dtype=dtype)))


def _cross_entropy(dtype):
    targets = torch.tensor([1, -100, 7])  # an ignored row
    _backward(fused_vocab_cross_entropy(_leaf(3, 8, dtype=dtype), targets))
    _backward(fused_vocab_cross_entropy(_leaf(3, 8, dtype=dtype), targets, inplace_backward=True))


def _softmax(dtype):
    mask = torch.rand(2, 1, 4, 4) > 0.5
    _backward(scaled_masked_softmax(_leaf(2, 2, 4, 4, dtype=dtype), mask, 0.5))
    _backward(scaled_masked_softmax(_leaf(2, 2, 4, 4, dtype=dtype), None, 0.5))


def _causal_softmax(dtype):
    _backward(scaled_upper_triang_masked_softmax(_leaf(2, 2, 4, 4, dtype=dtype), 0.5))


def _layer_norm(dtype):
    weight, bias = _leaf(8, dtype=dtype), _leaf(8, dtype=dtype)
    _backward(layer_norm(_leaf(3, 8, dtype=dtype), weight, bias))
    _backward(*fused_add_layer_norm(_leaf(3, 8, dtype=dtype), _leaf(3, 8, dtype=dtype), weight, bias,
                                    x_bias=_leaf(8, dtype=dtype)))


def _rms_norm(dtype):
    _backward(fused_rms_norm(_leaf(3, 8, dtype=dtype), _leaf(8, dtype=dtype), 1e-5))


def _swiglu(dtype):
    _backward(fused_swiglu(_leaf(3, 8, dtype=dtype)))


def _rotary(dtype):
    angles = torch.rand(4, 4)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    _backward(fused_apply_rotary(_leaf(1, 2, 4, 8, dtype=dtype), cos, sin))


def _grouped_gemm(dtype):
    _backward(grouped_gemm(_leaf(5, 4, dtype=dtype), _leaf(2, 4, 3, dtype=dtype), torch.tensor([2, 3])))


DRIVERS = {
    "bias_gelu": _bias_gelu,
    "scaled_masked_softmax": _softmax,
    "scaled_upper_triang_masked_softmax": _causal_softmax,
    "layer_norm": _layer_norm,
    "rms_norm": _rms_norm,
    "swiglu": _swiglu,
    "rotary": _rotary,
    "grouped_gemm": _grouped_gemm,
    "vocab_cross_entropy": _cross_entropy,
}
"""One run of each op with a CUDA twin through its public wrappers, forward and backward."""


def test_every_cuda_source_is_a_twin_with_a_driver():
    sources = {p.stem for p in CUDA_DIR.glob("*.cu")}
    assert sources == set(_common.CUDA_TWINS) == set(DRIVERS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("op", sorted(DRIVERS))
def test_wrapper_calls_every_binding_of_its_cuda_twin(cuda_twins, op, dtype):
    DRIVERS[op](dtype)
    twin = cuda_twins[op]
    assert set(twin.calls) == set(declared_bindings(CUDA_DIR / f"{op}.cu")), (
        f"{op} on CUDA called {sorted(set(twin.calls))}: a binding was never reached (the wrapper fell back?)")
    assert all(not other.calls for name, other in cuda_twins.items() if name != op)


@pytest.mark.parametrize("op", sorted(DRIVERS))
def test_float64_on_cuda_takes_the_pytorch_path(cuda_twins, op):
    """The twins have no float64 kernels (``ML_CUDA_DTYPE_CALL``): such tensors must never reach them."""
    DRIVERS[op](torch.float64)
    assert not cuda_twins[op].calls


def test_kernel_paths_report_the_cuda_twins(cuda_twins, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    paths = {op: cuda for op, _, cuda in _common.kernel_paths()}
    assert {op for op, path in paths.items() if path == "CUDA twin"} == set(_common.CUDA_TWINS)
    assert all(path.startswith("PyTorch fallback") for op, path in paths.items() if op not in _common.CUDA_TWINS)
