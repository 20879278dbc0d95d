"""Expert capacity at cp 2 follows Megatron-LM: each cp rank's router counts the capacity over its own tokens
(``ceil(c T_local k / E)``) and drops over it before dispatch. So an MoE layer at cp 2, its experts whole on every
rank (ep 1) or split over the two cp ranks (ep 2, all-to-all and all-gather dispatchers), gives each rank exactly
the output and input gradient of one process's layer run on that rank's tokens alone; and capacity binds here
(the output differs from the undropped layer's), so the test sees which tokens are dropped."""

from __future__ import annotations

import functools

import pytest
import torch

from megatron_like.config import Config, parse_config

SEQ, BATCH, HIDDEN = 32, 2, 32
FLAGS = ["--num-layers", "1", "--hidden-size", str(HIDDEN), "--num-attention-heads", "4", "--seq-length", str(SEQ),
         "--micro-batch-size", str(BATCH), "--global-batch-size", str(BATCH), "--mock-data", "--vocab-size", "64",
         "--swiglu", "--disable-bias-linear", "--num-experts", "4", "--moe-router-topk", "2",
         "--moe-ffn-hidden-size", "16", "--moe-router-load-balancing-type", "none"]
CAPACITY = ["--moe-expert-capacity-factor", "0.5"]
LAYOUTS = {
    "ep1": [],
    "ep2-alltoall": ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"],
    "ep2-allgather": ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "allgather"],
}


def config_of(layout: str, cp: int, capacity: bool = True) -> Config:
    flags = FLAGS + (CAPACITY if capacity else []) + (LAYOUTS[layout] if cp > 1 else [])
    return parse_config(flags + ["--context-parallel-size", str(cp)], world_size=cp)


def rank_tokens(cp_rank: int) -> torch.Tensor:
    """``[s / 2, b, h]``: the hidden states of cp rank ``cp_rank``'s two chunks of the sequence."""
    from megatron_like.model.context_parallel import split_for_context_parallel

    whole = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(5))
    return split_for_context_parallel(whole, 2, cp_rank, dim=0)


def moe_output(config: Config, ps, x: torch.Tensor) -> list[torch.Tensor]:
    """The MoE layer's output and input gradient on ``x`` (loss: the sum of squares)."""
    from megatron_like.model.moe import MoELayer

    layer = MoELayer(config.model, ps, 0, 1, False, torch.float32)
    x = x.clone().requires_grad_()
    out = layer(x)
    out.square().sum().backward()
    return [out.detach(), x.grad]


def on_ranks(rank: int, world_size: int) -> dict[str, list[torch.Tensor]]:
    from megatron_like.parallel_state import ParallelState

    results, states = {}, {}
    for layout in LAYOUTS:
        config = config_of(layout, world_size)
        ep = config.parallel.expert_model_parallel_size  # the two ep 2 layouts share their process groups
        if ep not in states:
            states[ep] = ParallelState.initialize(config.parallel, world_size)
        results[layout] = moe_output(config, states[ep], rank_tokens(rank))
    return results


@functools.cache
def runs() -> list[dict[str, list[torch.Tensor]]]:
    from tests.distributed.harness import run_distributed

    return run_distributed(on_ranks, 2)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_capacity_counts_each_cp_ranks_own_tokens(layout: str) -> None:
    from megatron_like.parallel_state import ParallelState

    single = ParallelState.single_process(torch.device("cpu"))
    for rank, per_rank in enumerate(runs()):
        expected = moe_output(config_of(layout, 1), single, rank_tokens(rank))
        for name, got, want in zip(("output", "input gradient"), per_rank[layout], expected):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=lambda m, n=name: f"rank {rank} {n}: {m}")
        undropped = moe_output(config_of(layout, 1, capacity=False), single, rank_tokens(rank))
        assert (undropped[0] - expected[0]).abs().max() > 0.1 * undropped[0].abs().max()  # capacity drops tokens here
