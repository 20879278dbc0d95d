"""Every fused kernel's CUDA twin, forward and backward, against PyTorch's own ops on CUDA, in fp32 and bf16.

Inputs are drawn on the CPU, rounded to the dtype and moved to the GPU; the reference runs PyTorch's ops in
float32 on the same rounded values. bf16 results carry the kernels' output rounding (and, for the fused add +
LayerNorm, the rounded sum), so they are compared at bf16's tolerance; fp32 at 1e-4 (the kernels reduce in
another order than PyTorch). Each test also checks that the CUDA twin ran (``twins_used``, conftest.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch
import torch.nn.functional as F

from megatron_like.kernels import (
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

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def compare_with_torch(fused: Callable, reference: Callable, inputs: Sequence[torch.Tensor], differentiable: set[int],
                       dtype: torch.dtype, device: torch.device) -> None:
    """Run ``fused`` on ``inputs`` in ``dtype`` on ``device`` and ``reference`` on float32 copies of the same
    values; compare the outputs and the gradients of the inputs at positions ``differentiable``."""
    gen = torch.Generator().manual_seed(0)
    leaves = [t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype) for t in inputs]
    ref_leaves = [t.float() if t.is_floating_point() else t for t in leaves]
    for i in differentiable:
        leaves[i].requires_grad_()
        ref_leaves[i] = ref_leaves[i].detach().requires_grad_()
    out, ref = fused(*leaves), reference(*ref_leaves)
    dy = torch.randn(out.shape, generator=gen).to(device=device, dtype=dtype)
    out.backward(dy)
    ref.backward(dy.float())
    assert out.dtype == dtype and out.device == device
    torch.testing.assert_close(out.float(), ref, **TOL[dtype], msg=lambda m: f"output: {m}")
    for i in sorted(differentiable):
        assert leaves[i].grad.dtype == dtype
        torch.testing.assert_close(leaves[i].grad.float(), ref_leaves[i].grad,
                                   **grad_tolerance(ref_leaves[i].grad, dtype),
                                   msg=lambda m, i=i: f"gradient of input {i}: {m}")


def grad_tolerance(reference: torch.Tensor, dtype: torch.dtype) -> dict[str, float]:
    """TOL, with bf16's absolute part scaled by the gradient's mean magnitude when that exceeds 1: a weight
    gradient summed over thousands of rows is rounded to bf16 at its own size (spacing 0.5 at 64) and each of its
    terms carries the kernels' rounding contract (the normalized value rounded to bf16), so its error grows with
    the sum, not with 0.02. The CPU kernels of the same contract differ from PyTorch's float32 by the same amounts;
    the float32 runs check the reductions themselves at 1e-4."""
    tolerance = dict(TOL[dtype])
    if dtype == torch.bfloat16:
        tolerance["atol"] *= max(1.0, float(reference.abs().mean()))
    return tolerance


def randn(*shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))) * scale + shift


# Rows: a few, and more than the weight-gradient kernels' 32 row lanes times their unroll, with a remainder (the
# column reductions of the norms and bias-GELU tile rows over lanes; 4133 = 32 * 129 + 5).
ROWS = [12, 4133]


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layer_norm(dtype, rows, device, twins_used):
    h = 1000  # not a multiple of the block size
    compare_with_torch(lambda x, w, b: layer_norm(x, w, b, 1e-5),
                       lambda x, w, b: F.layer_norm(x, (h,), w, b, 1e-5),
                       [randn(rows, h, scale=2, shift=1), randn(h, scale=0.1, shift=1), randn(h, scale=0.1)],
                       {0, 1, 2}, dtype, device)
    assert _loader.CUDA_MODULE_PREFIX + "layer_norm" in twins_used


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_add_layer_norm(dtype, rows, device, twins_used):
    h = 256

    def fused(x, residual, w, b, x_bias):
        out, total = fused_add_layer_norm(x, residual, w, b, 1e-5, x_bias=x_bias)
        return torch.stack([out, total])

    def reference(x, residual, w, b, x_bias):
        total = x + x_bias + residual
        return torch.stack([F.layer_norm(total, (h,), w, b, 1e-5), total])

    compare_with_torch(fused, reference, [randn(rows, h), randn(rows, h), randn(h, shift=1), randn(h), randn(h)],
                       {0, 1, 2, 3, 4}, dtype, device)
    assert _loader.CUDA_MODULE_PREFIX + "layer_norm" in twins_used


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm(dtype, rows, device, twins_used):
    h = 768
    compare_with_torch(lambda x, w: fused_rms_norm(x, w, 1e-6), lambda x, w: F.rms_norm(x, (h,), w, 1e-6),
                       [randn(rows, h, scale=2), randn(h, scale=0.1, shift=1)], {0, 1}, dtype, device)
    assert _loader.CUDA_MODULE_PREFIX + "rms_norm" in twins_used


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bias_gelu(dtype, rows, device, twins_used):
    h = 200  # not a multiple of the 32-column tile
    compare_with_torch(bias_gelu, lambda x, b: F.gelu(x + b, approximate="tanh"),
                       [randn(rows, h, scale=2), randn(h, scale=0.5)], {0, 1}, dtype, device)
    assert _loader.CUDA_MODULE_PREFIX + "bias_gelu" in twins_used


@pytest.mark.parametrize("inplace_backward", [False, True], ids=["fresh", "inplace"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_vocab_cross_entropy(dtype, inplace_backward, device, twins_used):
    vocab = 1000  # not a multiple of the 512-thread block
    targets = torch.randint(0, vocab, (37,), generator=torch.Generator().manual_seed(1))
    targets[[3, 20]] = -100  # ignored rows: zero loss and zero gradient

    def fused(logits):
        # the in-place backward writes over its input: hand it a copy so the reference's leaf stays intact
        logits = logits.clone() if inplace_backward else logits
        return fused_vocab_cross_entropy(logits, targets.to(device), inplace_backward=inplace_backward)

    compare_with_torch(fused, lambda x: F.cross_entropy(x, targets.to(device), reduction="none"),
                       [randn(37, vocab, scale=4)], {0}, dtype, device)
    assert _loader.CUDA_MODULE_PREFIX + "vocab_cross_entropy" in twins_used


def test_vocab_cross_entropy_refuses_a_target_outside_the_vocabulary(device):
    with pytest.raises(IndexError, match="target 1000 at row 1 is out of range for a vocabulary of 1000"):
        fused_vocab_cross_entropy(torch.zeros(2, 1000, device=device), torch.tensor([0, 1000], device=device))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_swiglu(dtype, device, twins_used):
    compare_with_torch(fused_swiglu, lambda g: F.silu(g[..., 0::2]) * g[..., 1::2], [randn(3, 5, 2 * 200, scale=3)],
                       {0}, dtype, device)
    assert _loader.CUDA_MODULE_PREFIX + "swiglu" in twins_used


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scaled_masked_softmax(dtype, device, twins_used):
    b, heads, s = 2, 3, 70
    mask = torch.rand(b, 1, s, s, generator=torch.Generator().manual_seed(1)) > 0.7
    mask[..., 0] = False  # no fully masked row: PyTorch's softmax would give NaN where the kernel gives 0

    def reference(x, mask):
        return torch.softmax((x * 0.125).masked_fill(mask, float("-inf")), dim=-1)

    compare_with_torch(lambda x, m: scaled_masked_softmax(x, m, 0.125), reference,
                       [randn(b, heads, s, s, scale=4), mask], {0}, dtype, device)
    assert _loader.CUDA_MODULE_PREFIX + "scaled_masked_softmax" in twins_used


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scaled_upper_triang_masked_softmax(dtype, device, twins_used):
    s = 130

    def reference(x):
        future = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        return torch.softmax((x * 0.5).masked_fill(future, float("-inf")), dim=-1)

    compare_with_torch(lambda x: scaled_upper_triang_masked_softmax(x, 0.5), reference, [randn(2, 2, s, s, scale=3)],
                       {0}, dtype, device)
    assert _loader.CUDA_MODULE_PREFIX + "scaled_upper_triang_masked_softmax" in twins_used


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seq", [1, 37], ids=["decode", "prefill"])
def test_rotary(dtype, seq, device, twins_used):
    head_dim, rotary_dim = 64, 32  # partial rotary: the last 32 features pass through
    angles = torch.arange(seq)[:, None] * torch.rand(rotary_dim // 2, generator=torch.Generator().manual_seed(2))
    cos = torch.cat([angles.cos()] * 2, dim=-1).to(device)
    sin = torch.cat([angles.sin()] * 2, dim=-1).to(device)

    def reference(x):
        rotated, passed = x[..., :rotary_dim], x[..., rotary_dim:]
        first, second = rotated.chunk(2, dim=-1)
        turned = torch.cat([-second, first], dim=-1)
        return torch.cat([rotated * cos.to(x.dtype) + turned * sin.to(x.dtype), passed], dim=-1)

    compare_with_torch(lambda x: fused_apply_rotary(x, cos, sin), reference, [randn(2, 4, seq, head_dim)], {0},
                       dtype, device)
    assert _loader.CUDA_MODULE_PREFIX + "rotary" in twins_used


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_grouped_gemm(dtype, device, twins_used):
    counts = [5, 0, 70, 33]  # an expert without tokens, groups across the 32-row tile
    k, n = 96, 40
    tokens_per_expert = torch.tensor(counts)

    def reference(x, w):
        return torch.cat([rows @ w[e] for e, rows in enumerate(x.split(counts))])

    compare_with_torch(lambda x, w: grouped_gemm(x, w, tokens_per_expert), reference,
                       [randn(sum(counts), k), randn(len(counts), k, n, scale=k**-0.5)], {0, 1}, dtype, device)
    assert _loader.CUDA_MODULE_PREFIX + "grouped_gemm" in twins_used
