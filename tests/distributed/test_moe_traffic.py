"""The planner's expert-parallel traffic (``planning.simulator.expert_parallel_bytes``) against the bytes the token
dispatchers send (``collectives.count_traffic``) in one MoE layer's forward and backward at ep 2."""

from __future__ import annotations

import functools

import pytest
import torch

from megatron_like.config import parse_config

FLAGS = ["--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "256",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--mock-data", "--vocab-size", "64", "--swiglu",
         "--disable-bias-linear", "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
         "--moe-router-load-balancing-type", "none", "--expert-model-parallel-size", "2"]
DISPATCHERS = ["alltoall", "allgather"]


def flags(dispatcher: str) -> list[str]:
    return FLAGS + ["--moe-token-dispatcher-type", dispatcher]


def measure(rank: int, world_size: int) -> dict[str, int]:
    """Bytes this rank sends in one MoE layer's forward and backward, per dispatcher."""
    from megatron_like import collectives
    from megatron_like.model.moe import MoELayer
    from megatron_like.parallel_state import ParallelState

    ps = ParallelState.initialize(parse_config(flags("alltoall"), world_size).parallel, world_size)
    sent = {}
    for dispatcher in DISPATCHERS:
        config = parse_config(flags(dispatcher), world_size)
        layer = MoELayer(config.model, ps, 0, 1, False, torch.float32)
        x = torch.randn(256, 2, 64, generator=torch.Generator().manual_seed(rank), requires_grad=True)
        with collectives.count_traffic() as traffic:
            layer(x).square().sum().backward()
        sent[dispatcher] = traffic.bytes_sent
    return sent


@functools.cache
def measured() -> list[dict[str, int]]:
    from tests.distributed.harness import run_distributed

    return run_distributed(measure, 2)


@pytest.mark.parametrize("dispatcher", DISPATCHERS)
def test_planned_dispatcher_bytes_match_the_counted_traffic(dispatcher: str) -> None:
    """allgather's traffic does not depend on routing (exact); alltoall's does: the plan assumes balanced routing,
    a random router's is within 10%."""
    from megatron_like.planning.simulator import expert_parallel_bytes

    planned = expert_parallel_bytes(parse_config(flags(dispatcher), world_size=2), 0)
    assert planned > 0
    for rank, sent in enumerate(measured()):
        if dispatcher == "allgather":
            assert sent[dispatcher] == planned, f"rank {rank}: sent {sent[dispatcher]}, planned {planned}"
        else:
            assert abs(sent[dispatcher] - planned) / planned < 0.10, f"rank {rank}: sent {sent[dispatcher]}, " \
                                                                      f"planned {planned}"
