"""``python -m megatron_like.kernels``: print the kernel path and PyTorch's CPU capability this environment gives,
then which path each compiled op takes on CPU and on CUDA (csrc ISA, CUDA twin, or PyTorch fallback).

Exits with the one-line error instead when ``MEGATRON_LIKE_ISA`` is invalid or names a path the CPU lacks;
``scripts/test.sh`` runs it before the suite (docs/kernels.md).
"""

import sys

import torch

from megatron_like.kernels._common import kernel_paths
from megatron_like.kernels._loader import csrc_isa

try:
    print(f"kernel path: {csrc_isa()}, PyTorch CPU capability: {torch.backends.cpu.get_cpu_capability()}")
    rows = [("op", "CPU tensors", "CUDA tensors"), *kernel_paths()]
except (RuntimeError, ValueError) as error:
    sys.exit(f"error: {error}")
widths = [max(len(row[i]) for row in rows) for i in range(3)]
for row in rows:
    print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
