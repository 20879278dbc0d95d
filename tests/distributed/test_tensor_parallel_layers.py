"""Each tensor-parallel block against its dense twin (tp=1): outputs and gradients."""

from __future__ import annotations

import pytest
import torch

from megatron_like import collectives as comm
from megatron_like.config import ParallelConfig
from megatron_like.parallel_state import ParallelState
from megatron_like.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    normal_init,
    vocab_parallel_cross_entropy,
)
from tests.distributed.harness import run_distributed

S, B, H, OUT, VOCAB = 8, 2, 16, 24, 32


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(S, B, H, generator=g), torch.randn(S, B, OUT, generator=g)


_STATES: dict[int, ParallelState] = {}


def _state(world_size: int) -> ParallelState:
    if world_size not in _STATES:
        _STATES[world_size] = ParallelState.initialize(ParallelConfig(tensor_model_parallel_size=world_size),
                                                       world_size)
    return _STATES[world_size]


def check_column(rank: int, world_size: int, sequence_parallel: bool, gather_output: bool) -> None:
    ps = _state(world_size)
    kwargs = dict(init_method=normal_init(0.5), seed=3, name="col")
    dense = ColumnParallelLinear(H, OUT, tp_group=None, **kwargs)
    par = ColumnParallelLinear(H, OUT, tp_group=ps.tp_group, gather_output=gather_output,
                               sequence_parallel=sequence_parallel, **kwargs)
    x, grad_out = _inputs()
    x_dense = x.clone().requires_grad_()
    dense(x_dense).backward(grad_out)
    x_local = comm.split_along_dim(x, ps.tp_group, 0) if sequence_parallel else x
    x_local = x_local.clone().requires_grad_()
    y = par(x_local)
    expected = dense(x) if gather_output else comm.split_along_dim(dense(x), ps.tp_group, -1)
    torch.testing.assert_close(y, expected.detach())
    y.backward(grad_out if gather_output else comm.split_along_dim(grad_out, ps.tp_group, -1))
    expected_dx = comm.split_along_dim(x_dense.grad, ps.tp_group, 0) if sequence_parallel else x_dense.grad
    torch.testing.assert_close(x_local.grad, expected_dx)
    torch.testing.assert_close(par.weight.grad, comm.split_along_dim(dense.weight.grad, ps.tp_group, 0))
    torch.testing.assert_close(par.bias.grad, comm.split_along_dim(dense.bias.grad, ps.tp_group, 0))


def check_row(rank: int, world_size: int, sequence_parallel: bool, input_is_parallel: bool) -> None:
    ps = _state(world_size)
    kwargs = dict(init_method=normal_init(0.5), seed=3, name="row")
    dense = RowParallelLinear(OUT, H, tp_group=None, **kwargs)
    par = RowParallelLinear(OUT, H, tp_group=ps.tp_group, input_is_parallel=input_is_parallel,
                            sequence_parallel=sequence_parallel, **kwargs)
    g = torch.Generator().manual_seed(11)
    x, grad_out = torch.randn(S, B, OUT, generator=g), torch.randn(S, B, H, generator=g)
    x_dense = x.clone().requires_grad_()
    y_dense = dense(x_dense)
    y_dense.backward(grad_out)
    x_local = (comm.split_along_dim(x, ps.tp_group, -1) if input_is_parallel else x).clone().requires_grad_()
    y = par(x_local)
    if sequence_parallel:
        torch.testing.assert_close(y, comm.split_along_dim(y_dense.detach(), ps.tp_group, 0))
        y.backward(comm.split_along_dim(grad_out, ps.tp_group, 0))
        # Sequence-parallel biases hold partial grads until the tp all-reduce of grad_sync.
        bias_grad = comm.all_reduce(par.bias.grad.clone(), ps.tp_group)
    else:
        torch.testing.assert_close(y, y_dense.detach())
        y.backward(grad_out)
        bias_grad = par.bias.grad
    expected_dx = comm.split_along_dim(x_dense.grad, ps.tp_group, -1) if input_is_parallel else x_dense.grad
    torch.testing.assert_close(x_local.grad, expected_dx)
    torch.testing.assert_close(par.weight.grad, comm.split_along_dim(dense.weight.grad, ps.tp_group, 1))
    torch.testing.assert_close(bias_grad, dense.bias.grad)


def check_embedding_and_cross_entropy(rank: int, world_size: int) -> None:
    ps = _state(world_size)
    kwargs = dict(init_method=normal_init(1.0), seed=5, name="emb")
    dense = VocabParallelEmbedding(VOCAB, H, tp_group=None, **kwargs)
    par = VocabParallelEmbedding(VOCAB, H, tp_group=ps.tp_group, **kwargs)
    g = torch.Generator().manual_seed(13)
    ids = torch.randint(0, VOCAB, (B, S), generator=g)
    grad_out = torch.randn(B, S, H, generator=g)
    y_dense, y = dense(ids), par(ids)
    torch.testing.assert_close(y, y_dense)
    y_dense.backward(grad_out)
    y.backward(grad_out)
    torch.testing.assert_close(par.weight.grad, comm.split_along_dim(dense.weight.grad, ps.tp_group, 0))

    logits = torch.randn(S, B, VOCAB, generator=g) * 3
    logits[0, 0, :] = -1e4  # extreme values must stay finite
    logits[0, 0, 5] = 1e4
    target = torch.randint(0, VOCAB, (S, B), generator=g)
    reference_logits = logits.clone().requires_grad_()
    reference = torch.nn.functional.cross_entropy(
        reference_logits.view(-1, VOCAB), target.view(-1), reduction="none"
    ).view(S, B)
    weights = torch.rand(S, B, generator=g)
    (reference * weights).sum().backward()
    local = comm.split_along_dim(logits, ps.tp_group, -1).clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, ps.tp_group)
    torch.testing.assert_close(loss, reference.detach())
    (loss * weights).sum().backward()
    torch.testing.assert_close(local.grad, comm.split_along_dim(reference_logits.grad, ps.tp_group, -1))


def check_all_blocks(rank: int, world_size: int) -> None:
    """Every block and variant in one process group: spawning processes costs more than the checks."""
    for sequence_parallel, gather_output in [(False, False), (False, True), (True, False)]:
        check_column(rank, world_size, sequence_parallel, gather_output)
    for sequence_parallel, input_is_parallel in [(False, True), (False, False), (True, True)]:
        check_row(rank, world_size, sequence_parallel, input_is_parallel)
    check_embedding_and_cross_entropy(rank, world_size)


@pytest.mark.parametrize("world_size", [2, 4])
def test_tensor_parallel_blocks_match_dense_twins(world_size):
    run_distributed(check_all_blocks, world_size)
