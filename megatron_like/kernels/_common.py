"""Helpers shared by the kernel wrappers: which tensors the C++ path takes, dtype codes, threads."""

from __future__ import annotations

import torch

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


def cpu_supported(*tensors: torch.Tensor | None) -> bool:
    """Return whether the C++ kernels can take these tensors: on CPU, one supported float dtype.

    Non-contiguous inputs are accepted: the wrappers make them contiguous, since one copy still
    beats the unfused fallback.
    """
    dtype = None
    for t in tensors:
        if t is None:
            continue
        if t.device.type != "cpu" or t.dtype not in DTYPE_CODES:
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
