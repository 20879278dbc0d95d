"""Fused bias + GELU (tanh) against PyTorch's gelu(approximate="tanh")."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_like.kernels import bias_gelu
from tests.unit._kernel_backends import backend  # noqa: F401 - fixture

pytestmark = pytest.mark.usefixtures("backend")


@pytest.mark.parametrize("shape", [(4, 3, 40), (7, 1), (2, 129)])
def test_bias_gelu_matches_reference(shape):
    gen = torch.Generator().manual_seed(0)
    h = shape[-1]
    x = (torch.randn(shape, generator=gen) * 3).requires_grad_()
    bias = torch.randn(h, generator=gen).requires_grad_()
    y = bias_gelu(x, bias)
    rx, rb = x.detach().double().requires_grad_(), bias.detach().double().requires_grad_()
    ref = F.gelu(rx + rb, approximate="tanh")
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-6)
    dy = torch.randn(shape, generator=gen)
    y.backward(dy)
    ref.backward(dy.double())
    torch.testing.assert_close(x.grad.double(), rx.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bias.grad.double(), rb.grad, rtol=1e-5, atol=1e-5)


def test_bias_gelu_extreme_inputs_saturate():
    x = torch.tensor([[-1e4, -50.0, -8.0, -1e-6, 0.0, 1e-6, 8.0, 50.0, 1e4]])
    bias = torch.zeros(9)
    y = bias_gelu(x, bias)
    ref = F.gelu(x.double(), approximate="tanh")
    torch.testing.assert_close(y.double(), ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bias_gelu_half_precision(dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 50, generator=gen).to(dtype).requires_grad_()
    bias = torch.randn(50, generator=gen).to(dtype).requires_grad_()
    y = bias_gelu(x, bias)
    assert y.dtype == dtype
    ref = F.gelu(x.detach().double() + bias.detach().double(), approximate="tanh")
    torch.testing.assert_close(y.double(), ref, rtol=1e-2, atol=1e-2)
    y.float().sum().backward()
    assert x.grad.dtype == bias.grad.dtype == dtype


def test_bias_gelu_no_bias_grad_needed():
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(3, 8, generator=gen) * 3).requires_grad_()
    bias = torch.randn(8, generator=gen)
    bias_gelu(x, bias).sum().backward()
    rx = x.detach().clone().requires_grad_()
    F.gelu(rx.double() + bias.double(), approximate="tanh").sum().backward()
    torch.testing.assert_close(x.grad, rx.grad, rtol=1e-5, atol=1e-5)


def test_bias_gelu_gradcheck_float64():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    bias = torch.randn(5, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradcheck(bias_gelu, (x, bias))


def test_bias_gelu_rejects_wrong_bias():
    with pytest.raises(ValueError, match="bias"):
        bias_gelu(torch.randn(2, 4), torch.randn(3))
