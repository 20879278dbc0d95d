"""CPU Adam/AdamW (fused C++ pass and its fallback) against torch.optim.AdamW / Adam over many steps."""

from __future__ import annotations

import copy

import pytest
import torch

from megatron_like.kernels import CPUAdam, adam_step_
from tests.unit._kernel_backends import backend  # noqa: F401 - fixture

pytestmark = pytest.mark.usefixtures("backend")

SHAPES = [(1000,), (37, 13), (1,), (3, 1, 70)]


def make_params(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).requires_grad_() for s in SHAPES]


def run_steps(opt: torch.optim.Optimizer, params: list[torch.Tensor], steps: int, seed: int, **step_kwargs) -> None:
    gen = torch.Generator().manual_seed(seed)
    for i in range(steps):
        for p in params:
            # Mix scales so that some coordinates see tiny and some large updates.
            p.grad = torch.randn(p.shape, generator=gen) * (10.0 ** (i % 3 - 1))
        if i == steps // 2:
            for group in opt.param_groups:
                group["lr"] *= 0.5  # a schedule changes lr mid-run
        opt.step(**step_kwargs)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_cpu_adamw_matches_torch_adamw(weight_decay):
    ours, theirs = make_params(0), make_params(0)
    kwargs = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay)
    opt = CPUAdam(ours, **kwargs)
    ref = torch.optim.AdamW(theirs, **kwargs)
    run_steps(opt, ours, 60, seed=1)
    run_steps(ref, theirs, 60, seed=1)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        for key in ("exp_avg", "exp_avg_sq"):
            # Gradients reach 10 and cancel in exp_avg: atol is relative to that scale, not to the result.
            torch.testing.assert_close(opt.state[a][key], ref.state[b][key], rtol=1e-5, atol=1e-6)
        assert float(opt.state[a]["step"]) == float(ref.state[b]["step"]) == 60


def test_cpu_adam_l2_mode_matches_torch_adam():
    ours, theirs = make_params(2), make_params(2)
    opt = CPUAdam(ours, lr=3e-3, weight_decay=0.05, adamw_mode=False)
    ref = torch.optim.Adam(theirs, lr=3e-3, weight_decay=0.05)
    run_steps(opt, ours, 40, seed=3)
    run_steps(ref, theirs, 40, seed=3)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("copy_dtype", [torch.bfloat16, torch.float16])
def test_param_copy_holds_rounded_updated_params(copy_dtype):
    params = make_params(4)
    copies = {p: torch.empty(p.shape, dtype=copy_dtype) for p in params}
    opt = CPUAdam(params, lr=1e-2)
    run_steps(opt, params, 5, seed=5, param_copies=copies)
    for p, low in copies.items():
        # Exactly torch's round-to-nearest-even cast of the fp32 master.
        assert torch.equal(low, p.detach().to(copy_dtype))


def test_fp16_copy_rounding_edge_cases():
    values = torch.tensor([0.0, -0.0, 1e-8, 6e-5, 65504.0, 65520.0, 1e6, float("inf"), -3.14159, 2.0**-24 * 1.5])
    param = values.clone()
    zeros = torch.zeros_like(param)
    copy = torch.empty(param.shape, dtype=torch.float16)
    # lr = 0 and no decay: the param is unchanged, so the copy is just the fp16 cast.
    adam_step_(param, zeros, zeros.clone(), zeros.clone(), step=1, lr=0.0, param_copy=copy)
    assert torch.equal(copy, values.to(torch.float16))
    bf16 = torch.empty(param.shape, dtype=torch.bfloat16)
    adam_step_(param, zeros, zeros.clone(), zeros.clone(), step=1, lr=0.0, param_copy=bf16)
    assert torch.equal(bf16, values.to(torch.bfloat16))


def test_adam_step_on_flat_shard_and_noncontiguous_fallback():
    gen = torch.Generator().manual_seed(6)
    master = torch.randn(4, 50, generator=gen)
    grad = torch.randn(4, 50, generator=gen)
    ref = master.clone().requires_grad_()
    ref.grad = grad.clone()
    torch.optim.AdamW([ref], lr=1e-3, weight_decay=0.01).step()
    flat = master.clone().view(-1)
    adam_step_(flat, grad.view(-1), torch.zeros(200), torch.zeros(200), step=1, lr=1e-3, weight_decay=0.01)
    torch.testing.assert_close(flat.view(4, 50), ref.detach())
    strided = master.clone().t()  # non-contiguous: takes the PyTorch path, same result
    adam_step_(strided, grad.t(), torch.zeros(50, 4), torch.zeros(50, 4), step=1, lr=1e-3, weight_decay=0.01)
    torch.testing.assert_close(strided.t(), ref.detach())


def test_state_dict_interchangeable_with_torch_adamw():
    ours, theirs = make_params(7), make_params(7)
    ref = torch.optim.AdamW(theirs, lr=1e-3)
    run_steps(ref, theirs, 3, seed=8)
    for a, b in zip(ours, theirs):
        a.data.copy_(b.data)
    opt = CPUAdam(ours, lr=1e-3)
    # deepcopy: load_state_dict would otherwise share the moment tensors between the two optimizers.
    opt.load_state_dict(copy.deepcopy(ref.state_dict()))
    run_steps(opt, ours, 4, seed=9)
    run_steps(ref, theirs, 4, seed=9)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_invalid_arguments():
    with pytest.raises(ValueError, match="betas"):
        CPUAdam(make_params(0), betas=(1.0, 0.9))
