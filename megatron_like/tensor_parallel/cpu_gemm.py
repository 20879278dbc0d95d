"""The CPU fp32 GEMM behind the tensor-parallel linears: MKL (``F.linear``) or oneDNN (``--cpu-gemm-backend``).

CPU builds of torch carry two fp32 GEMM libraries. ``F.linear``/``mm`` call MKL; oneDNN is reachable
through ``torch.ops.mkldnn._linear_pointwise`` (the op ``torch.compile`` emits for CPU linears). On the
2-core AMD EPYC of docs/performance.md oneDNN is 8-17% faster on the Llama benchmark's forward and
input-gradient GEMMs (e.g. the SwiGLU input ``[2048 x 512] @ [512 x 2816]``: 65 vs 85 ms, one thread),
and no faster on the weight gradient, so:

- forward ``y = x W^T + b`` and input gradient ``dx = dy W`` run through oneDNN (the transposed weight is
  passed as a strided view: oneDNN reads it without a copy made here);
- the weight gradient ``dW = dy^T x`` (and ``db = sum dy``) stays with ``mm``, exactly as ``F.linear``'s
  backward computes it.

The choice is made by a fixed rule, never by timing, so a run is reproducible:

- ``mkl``: always ``F.linear``.
- ``onednn``: oneDNN for every fp32 CPU linear (outside ``torch.compile``, which picks its own kernels, and
  ``torch.export``, whose graphs stay portable).
- ``auto`` (default): ``onednn`` on AMD CPUs (``vendor_id`` AuthenticAMD in /proc/cpuinfo) for GEMMs of
  at least ``ONEDNN_MIN_MACS`` multiply-adds, ``mkl`` otherwise. Below that size oneDNN's fixed cost per
  call (about 30 us more than MKL at 64 x 64 x 192) outweighs its faster kernel. On Intel CPUs MKL is
  kept because oneDNN was not measured there (MKL is Intel's own library and may well be the faster).

Both libraries give the same results within fp32 rounding (``tests/unit/test_cpu_gemm.py``); a run uses
one backend throughout, so tensor-parallel layouts still equal one process within the usual tolerances.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F

BACKENDS = ("auto", "mkl", "onednn")
ONEDNN_MIN_MACS = 1 << 24  # rows * in * out; e.g. the Llama benchmark's smallest GEMM has 2048 * 512 * 512


def onednn_available() -> bool:
    """This torch build has oneDNN's linear op (CPU builds do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@lru_cache(maxsize=1)
def cpu_vendor() -> str:
    """``vendor_id`` of the first CPU in /proc/cpuinfo ("AuthenticAMD", "GenuineIntel"; "" if unknown)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def resolve_backend(name: str) -> str:
    """``--cpu-gemm-backend`` -> the rule a linear applies: "mkl", "onednn" or "auto_onednn" (oneDNN from
    ``ONEDNN_MIN_MACS`` up). Without oneDNN in the build every choice is "mkl" (``onednn`` itself is
    rejected earlier, by ``ModelConfig.validate``)."""
    if name not in BACKENDS:
        raise ValueError(f"--cpu-gemm-backend {name!r}: expected one of {', '.join(BACKENDS)}")
    if name == "mkl" or not onednn_available():
        return "mkl"
    if name == "onednn":
        return "onednn"
    return "auto_onednn" if cpu_vendor() == "AuthenticAMD" else "mkl"


def _onednn_linear(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x2d [n, in] @ weight[out, in]^T (+ bias)`` -> ``[n, out]`` through oneDNN (``weight`` may be strided)."""
    return torch.ops.mkldnn._linear_pointwise(x2d, weight, bias, "none", [], "")


class _OneDNNLinear(torch.autograd.Function):
    """``F.linear`` with the forward and input-gradient GEMMs in oneDNN; ``x [..., in]`` -> ``[..., out]``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x2d = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x2d, weight)
        ctx.has_bias = bias is not None
        return _onednn_linear(x2d, weight, bias).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x2d, weight = ctx.saved_tensors
        grad2d = grad.reshape(-1, grad.shape[-1])  # (n, out)
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = _onednn_linear(grad2d, weight.t(), None).view(*grad.shape[:-1], weight.shape[1])
        if ctx.needs_input_grad[1]:
            grad_weight = grad2d.t().mm(x2d)  # MKL: oneDNN was not faster for this one
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad2d.sum(0)
        return grad_x, grad_weight, grad_bias


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, backend: str) -> torch.Tensor:
    """``x [..., in] @ weight[out, in]^T + bias`` -> ``[..., out]`` with the GEMM library of ``backend``
    (from ``resolve_backend``); anything but fp32 on CPU outside ``torch.compile``/``torch.export`` goes to
    ``F.linear`` (the compilers pick their own kernels; an exported graph stays portable)."""
    if (
        backend == "mkl"
        or x.device.type != "cpu"
        or x.dtype != torch.float32
        or weight.dtype != torch.float32
        or (bias is not None and bias.dtype != torch.float32)
        or torch.compiler.is_compiling()
        or torch.compiler.is_exporting()
    ):
        return F.linear(x, weight, bias)
    if backend == "auto_onednn" and x.numel() * weight.shape[0] < ONEDNN_MIN_MACS:
        return F.linear(x, weight, bias)
    return _OneDNNLinear.apply(x, weight, bias)
