"""Helpers shared by the kernel wrappers: which tensors the C++ path takes, dtype codes, threads."""

from __future__ import annotations

from types import ModuleType

import torch

from megatron_like.kernels._loader import CUDA_MODULE_PREFIX, KERNEL_MODULES, csrc_disabled, load

# Must match ml::DType in csrc/common.h.
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 0,
    torch.float64: 1,
    torch.bfloat16: 2,
    torch.float16: 3,
}


def dtype_code(dtype: torch.dtype) -> int:
    """Return the csrc code of a floating dtype (see ``ml::DType``)."""
    return DTYPE_CODES[dtype]


def _not_exporting() -> bool:
    return False


# Looked up once: the choice of kernel runs on every fused op, and these are its cost after the tensor checks.
_is_compiling = torch.compiler.is_compiling
_is_exporting = getattr(torch.compiler, "is_exporting", _not_exporting)


def _tracing() -> bool:
    """Whether torch.compile or torch.export is tracing (tensors are fake: no data pointers)."""
    return _is_compiling() or _is_exporting()


def device_type_of(tensor: torch.Tensor) -> str:
    """Return the device type the kernel choice sees: ``tensor.device.type``.

    The one place the choice reads it, so a CPU-only test can make CPU tensors look like CUDA ones and
    drive every wrapper's CUDA branch into a stand-in CUDA twin (tests/unit/test_kernels_cuda_bindings.py).
    ``is_cpu`` answers the common case without building a ``torch.device`` (several times as costly).
    """
    return "cpu" if tensor.is_cpu else tensor.device.type


def cpu_supported(*tensors: torch.Tensor | None) -> bool:
    """Return whether the C++ kernels can take these tensors: on CPU, one supported float dtype.

    Non-contiguous inputs are accepted: the wrappers make them contiguous, since one copy still
    beats the unfused fallback. Under ``torch.compile`` / ``torch.export`` tracing tensors have no data
    pointers: the traced graph gets the PyTorch fallback, which the compiler fuses itself.
    """
    if _tracing():
        return False
    dtype = None
    for t in tensors:
        if t is None:
            continue
        if device_type_of(t) != "cpu" or t.dtype not in DTYPE_CODES:
            return False
        if dtype is None:
            dtype = t.dtype
        elif t.dtype != dtype:
            return False
    return True


def threads() -> int:
    """Return the thread count kernels use: torch's, so ``torch.set_num_threads`` governs both."""
    return torch.get_num_threads()


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """Return the dtype of per-row statistics kept for ``dtype`` data (float32, float64 for float64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


CUDA_TWINS = (
    "bias_gelu",
    "scaled_masked_softmax",
    "scaled_upper_triang_masked_softmax",
    "layer_norm",
    "rms_norm",
    "swiglu",
    "rotary",
    "grouped_gemm",
    "vocab_cross_entropy",
)
"""Ops with a CUDA build (``csrc/cuda/<name>.cu`` -> ``megatron_like._csrc.cuda_<name>``)."""


def cuda_supported(*tensors: torch.Tensor | None) -> bool:
    """Return whether the CUDA twins can take these tensors: on one CUDA device, float32/bf16/fp16."""
    if _tracing():
        return False
    present = [t for t in tensors if t is not None]
    devices = {t.device for t in present}
    dtypes = {t.dtype for t in present}
    return (
        len(devices) == 1
        and all(device_type_of(t) == "cuda" for t in present)
        and len(dtypes) == 1
        and next(iter(dtypes)) in (torch.float32, torch.bfloat16, torch.float16)
    )


def pick_kernel(name: str, *tensors: torch.Tensor | None) -> tuple[ModuleType, int] | None:
    """Return (compiled module, last argument) for op ``name`` on these tensors, or None for the fallback.

    CPU tensors get ``megatron_like._csrc.<name>`` and the thread count; CUDA tensors get the CUDA twin
    ``megatron_like._csrc.cuda_<name>`` and the current stream handle (both modules share signatures).
    """
    if cpu_supported(*tensors):
        module = load(name)
        return None if module is None else (module, threads())
    if name in CUDA_TWINS and cuda_supported(*tensors):
        module = load(CUDA_MODULE_PREFIX + name)
        device = next(t.device for t in tensors if t is not None)
        return None if module is None else (module, cuda_stream_handle(device))
    return None


def cuda_stream_handle(device: torch.device) -> int:
    """Return the raw ``cudaStream_t`` of ``device``'s current stream, which the CUDA twins launch on."""
    return torch.cuda.current_stream(device).cuda_stream


def kernel_paths() -> list[tuple[str, str, str]]:
    """Return ``(op, CPU path, CUDA path)`` for every compiled op: what its float tensors run on each device.

    A path is ``csrc <isa>`` (the C++ kernel on that vector path), ``CUDA twin`` or ``PyTorch fallback``
    with the reason in parentheses; CUDA twins are only loaded when a CUDA device exists.
    """
    missing = "PyTorch fallback (MEGATRON_LIKE_NO_CSRC set)" if csrc_disabled() else "PyTorch fallback (not built)"
    cuda_device = torch.cuda.is_available()
    rows = []
    for op in KERNEL_MODULES:
        module = load(op)
        cpu = missing if module is None else f"csrc {module.isa()}"
        if op not in CUDA_TWINS:
            cuda = "PyTorch fallback (no CUDA twin)"
        elif not cuda_device:
            cuda = "no CUDA device"
        else:
            cuda = missing if load(CUDA_MODULE_PREFIX + op) is None else "CUDA twin"
        rows.append((op, cpu, cuda))
    return rows
