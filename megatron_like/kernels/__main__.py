"""``python -m megatron_like.kernels``: print the kernel path and PyTorch's CPU capability this environment gives.

Exits with the one-line error instead when ``MEGATRON_LIKE_ISA`` is invalid or names a path the CPU lacks;
``scripts/test.sh`` runs it before the suite (docs/kernels.md).
"""

import sys

import torch

from megatron_like.kernels._loader import csrc_isa

try:
    print(f"kernel path: {csrc_isa()}, PyTorch CPU capability: {torch.backends.cpu.get_cpu_capability()}")
except (RuntimeError, ValueError) as error:
    sys.exit(f"error: {error}")
