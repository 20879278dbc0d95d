"""Grouped GEMM over the experts' row groups against independent references, on every backend."""

from __future__ import annotations

import pytest
import torch

from megatron_like.kernels import _common, _loader, grouped_gemm
from megatron_like.kernels.grouped_gemm import grouped_gemm_reference
from tests.unit._kernel_backends import backend, compiled  # noqa: F401 - fixture

pytestmark = pytest.mark.usefixtures("backend")

# Sizes that cross every blocking edge of csrc/grouped_gemm_kernels.h: partial MR x NR tiles, a group
# taller than one MC block (96 rows), k and a group longer than one KC block (256: the dw product's K is a
# group's row count), and empty groups at the start, middle and end.
COUNTS = [0, 130, 3, 0, 290, 1, 0]
K, N = 300, 45


def per_row_reference(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """y[t] = x[t] @ w[expert of t] in float64, written without the group loop of the contract."""
    expert_of_row = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    return torch.einsum("tk,tkn->tn", x.double(), w.double()[expert_of_row])


def inputs(counts: list[int], k: int, n: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), k, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(len(counts), k, n, generator=gen) / k**0.5).to(dtype).requires_grad_()
    dy = torch.randn(sum(counts), n, generator=gen).to(dtype)
    return x, w, dy


def run(x, w, dy, counts):
    """Forward and backward through grouped_gemm; return (y, dx, dw)."""
    x.grad = w.grad = None
    y = grouped_gemm(x, w, torch.tensor(counts))
    y.backward(dy)
    return y, x.grad, w.grad


def reference(x, w, dy, counts):
    """Float64 (y, dx, dw) of the per-row reference."""
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y = per_row_reference(xr, wr, counts)
    y.backward(dy.double())
    return y, xr.grad, wr.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grouped_gemm_matches_per_row_reference(dtype):
    x, w, dy = inputs(COUNTS, K, N, dtype)
    got = run(x, w, dy, COUNTS)
    want = reference(x, w, dy, COUNTS)
    # bf16: inputs are exact in both, products accumulate in fp32, so only the final rounding differs. fp32: dw sums
    # hundreds of products of size ~1 in the kernel's (or BLAS's) order; PyTorch's unvectorized BLAS path
    # (MEGATRON_LIKE_ISA=scalar) reaches 3e-5 against float64. A wrong tile or a missed block errs by ~1.
    rtol, atol = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (8e-3, 1e-2), torch.float16: (2e-3, 2e-3)}[dtype]
    for name, g, r in zip(("y", "dx", "dw"), got, want):
        assert g.dtype == dtype
        torch.testing.assert_close(g.double(), r, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")
    for e, c in enumerate(COUNTS):  # an expert without tokens gets exactly zero gradient
        if c == 0:
            assert torch.count_nonzero(got[2][e]) == 0


def test_grouped_gemm_bf16_matches_float64_and_loop_of_mm(backend):  # noqa: F811 - the fixture, for its name
    """bf16 accumulates in fp32 and rounds once, like torch.mm: each is one bf16 rounding from float64."""
    x, w, dy = inputs(COUNTS, K, N, torch.bfloat16, seed=1)
    got = run(x, w, dy, COUNTS)
    for g, r in zip(got, reference(x, w, dy, COUNTS)):
        torch.testing.assert_close(g.double(), r, rtol=8e-3, atol=1e-2)
    if compiled(backend):  # the fallback is this very loop: comparing them would prove nothing
        xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        y = grouped_gemm_reference(xr, wr, torch.tensor(COUNTS))
        y.backward(dy)
        for g, r in zip(got, (y, xr.grad, wr.grad)):
            torch.testing.assert_close(g, r, rtol=8e-3, atol=1e-2)


def test_grouped_gemm_wide_output_crosses_column_blocks():
    """n above one NC block (1024 columns), one expert empty: checks the column blocking of all three products."""
    counts = [40, 0, 9]
    x, w, dy = inputs(counts, 20, 1030, torch.float32, seed=2)
    for g, r in zip(run(x, w, dy, counts), reference(x, w, dy, counts)):
        torch.testing.assert_close(g.double(), r, rtol=1e-5, atol=1e-5)


def test_grouped_gemm_zero_tokens():
    x, w, dy = inputs([0, 0, 0], 8, 5, torch.float32)
    y, dx, dw = run(x, w, dy, [0, 0, 0])
    assert y.shape == (0, 5) and dx.shape == (0, 8)
    assert dw.shape == (3, 8, 5) and torch.count_nonzero(dw) == 0


def test_grouped_gemm_input_without_grad():
    counts = [3, 4]
    x, w, dy = inputs(counts, 6, 7, torch.float32)
    x = x.detach()
    y = grouped_gemm(x, w, torch.tensor(counts))
    y.backward(dy)
    torch.testing.assert_close(w.grad.double(), reference(x, w, dy, counts)[2], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemm_threads_do_not_change_the_result(backend, dtype):  # noqa: F811 - the fixture, for its name
    """The kernel sums every output element in the same order on any thread count: bit-equal results."""
    counts = [200, 0, 180, 150]
    x, w, dy = inputs(counts, 128, 96, dtype, seed=3)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [t.clone() for t in run(x, w, dy, counts)]
        torch.set_num_threads(2)
        two = run(x, w, dy, counts)
    finally:
        torch.set_num_threads(before)
    tol = 0 if compiled(backend) else 1e-2  # the fallback's BLAS may block differently per thread count
    for a, b in zip(one, two):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_grouped_gemm_gradcheck_float64():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(7, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(3, 5, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    counts = torch.tensor([2, 0, 5])
    assert torch.autograd.gradcheck(lambda a, b: grouped_gemm(a, b, counts), (x, w))


def test_grouped_gemm_runs_the_compiled_kernel(backend, monkeypatch):  # noqa: F811 - the fixture, for its name
    """With csrc built, CPU tensors must take the C++ path (a silent fallback would still pass the numerics)."""
    used = []

    def spy_load(name):
        module = _loader.load(name)
        used.append((name, module is not None))
        return module

    monkeypatch.setattr(_common, "load", spy_load)
    x, w, dy = inputs([2, 3], 4, 5, torch.float32)
    y = grouped_gemm(x, w, torch.tensor([2, 3]))
    if compiled(backend):
        assert ("grouped_gemm", True) in used
        assert type(y.grad_fn).__name__ == "GroupedGemmBackward"
        assert _loader.load("grouped_gemm").isa() == backend
    else:
        assert type(y.grad_fn).__name__ != "GroupedGemmBackward"


@pytest.mark.parametrize(
    ("x_shape", "w_shape", "counts", "match"),
    [
        ((4, 3), (2, 5, 6), [2, 2], "k=3 columns"),
        ((4, 3), (2, 3, 6), [1, 2], "sum to the 4 rows"),
        ((4, 3), (2, 3, 6), [5, -1], ">= 0"),
        ((4, 3), (2, 3, 6), [4], "one entry per expert"),
        ((4,), (2, 3, 6), [2, 2], r"x must be \[T, k\]"),
    ],
)
def test_grouped_gemm_rejects_bad_input(x_shape, w_shape, counts, match):
    with pytest.raises(ValueError, match=match):
        grouped_gemm(torch.randn(x_shape), torch.randn(w_shape), torch.tensor(counts))


def test_grouped_gemm_rejects_counts_off_cpu_or_not_int64():
    with pytest.raises(ValueError, match="CPU int64"):
        grouped_gemm(torch.randn(4, 3), torch.randn(2, 3, 6), torch.tensor([2, 2], dtype=torch.int32))
