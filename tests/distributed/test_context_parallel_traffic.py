"""The planner's context-parallel traffic (``planning.context_parallel``) against the bytes the attention layer
actually sends (``collectives.count_traffic``) in one forward and backward at cp 4 on four ranks: each
--cp-comm-type (a2a+p2p as 2 x 2), the ring in bf16 (its dK/dV travel in float32), the ring with packed
documents (their ids all-gathered) under selective recomputation (the forward's exchanges run again), and
multi-latent attention in each mode (full per-head keys of nope + rope features, values of a narrower head dim).
For multi-latent attention the bytes its layer keeps for backward are checked against the planner's too."""

from __future__ import annotations

import functools

import pytest
import torch

from megatron_like.config import Config, parse_config

CP = 4
FLAGS = ["--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "8", "--position-embedding-type", "rope",
         "--seq-length", "64",
         "--micro-batch-size", "2", "--global-batch-size", "2", "--mock-data", "--vocab-size", "64",
         "--disable-bias-linear", "--attention-dropout", "0", "--hidden-dropout", "0",
         "--context-parallel-size", str(CP)]
GQA = ["--group-query-attention", "--num-query-groups", "4"]
MLA = ["--multi-latent-attention", "--kv-lora-rank", "16", "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4",
       "--v-head-dim", "6"]
A2A_P2P = ["--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2", "2"]
CASES = {
    "p2p": GQA + ["--cp-comm-type", "p2p"],
    "all_gather": GQA + ["--cp-comm-type", "all_gather"],
    "a2a": GQA + ["--cp-comm-type", "a2a"],
    "a2a+p2p": GQA + A2A_P2P,
    "p2p-bf16": GQA + ["--cp-comm-type", "p2p", "--bf16"],
    "p2p-documents-selective": GQA + ["--cp-comm-type", "p2p", "--recompute-granularity", "selective"],
    "mla-p2p-bf16": MLA + ["--cp-comm-type", "p2p", "--bf16"],
    "mla-all_gather": MLA + ["--cp-comm-type", "all_gather"],
    "mla-a2a": MLA + ["--cp-comm-type", "a2a"],
    "mla-a2a+p2p": MLA + A2A_P2P,
}


def case_config(case: str) -> Config:
    config = parse_config(FLAGS + CASES[case], world_size=CP)
    # --reset-attention-mask needs end-of-document tokens, which --mock-data lacks: set on the parsed config
    config.data.reset_attention_mask = "documents" in case
    return config


def measure(rank: int, world_size: int) -> dict[str, tuple[int, int]]:
    """Per case: (bytes this rank sends in one transformer layer's forward and backward, bytes the forward keeps
    for backward: the autograd saved tensors, parameters excluded, each storage once)."""
    from megatron_like import collectives
    from megatron_like.model.context_parallel import split_for_context_parallel
    from megatron_like.model.transformer import TransformerLayer
    from megatron_like.parallel_state import ParallelState

    # One set of process groups for every case (the a2a+p2p layout's: it has every group the others use); each case
    # picks its mode.
    ps = ParallelState.initialize(case_config("a2a+p2p").parallel, world_size)
    sent = {}
    for case in CASES:
        config = case_config(case)
        ps.cp_comm_type = config.parallel.cp_comm_type
        dtype = torch.bfloat16 if config.precision.bf16 else torch.float32
        layer = TransformerLayer(config.model, ps, 0, 1, False, dtype)
        params = {param.untyped_storage().data_ptr() for param in layer.parameters()}
        kept: dict[int, int] = {}

        def pack(tensor: torch.Tensor, params=params, kept=kept) -> torch.Tensor:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in params:
                kept[storage.data_ptr()] = storage.nbytes()
            return tensor

        s, b = config.model.seq_length, config.training.micro_batch_size
        x = torch.randn(s // CP, b, 64, generator=torch.Generator().manual_seed(rank), dtype=dtype,
                        requires_grad=True)
        documents = None
        if config.data.reset_attention_mask:  # documents of 10 tokens, cut by the chunk boundaries
            documents = split_for_context_parallel(torch.arange(s).div(10, rounding_mode="floor").expand(b, s),
                                                   CP, ps.cp_rank)
        with collectives.count_traffic() as traffic:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                out = layer(x, document_ids=documents)
            out.float().square().sum().backward()
        sent[case] = (traffic.bytes_sent, sum(kept.values()))
    return sent


@functools.cache
def measured() -> list[dict[str, int]]:
    from tests.distributed.harness import run_distributed

    return run_distributed(measure, CP)


@pytest.mark.parametrize("case", list(CASES))
def test_planned_cp_bytes_match_the_counted_traffic(case: str) -> None:
    from megatron_like.planning.context_parallel import context_parallel_bytes

    config = case_config(case)
    assert config.num_microbatches == 1 and config.model.num_layers == 1  # the plan is per iteration
    planned = context_parallel_bytes(config, 0)
    assert planned > 0
    for rank, per_case in enumerate(measured()):
        sent = per_case[case][0]
        assert sent == planned, f"rank {rank}: sent {sent}, planned {planned}"


@pytest.mark.parametrize("case", [case for case in CASES if case.startswith("mla")])
def test_planned_cp_layer_activations_match_the_saved_tensors(case: str) -> None:
    """Multi-latent attention around the cp attention: what the layer keeps (s / cp tokens; q and k, the values and
    output as each mode keeps them, the gathered keys and values of all_gather) against the planner's formula, within
    the unit test's 2% (the rotary tables at the rank's positions are not counted)."""
    from megatron_like.planning.activations import layer_activation_bytes

    config = case_config(case)
    planned = layer_activation_bytes(config, config.model.recompute_granularity, "cpu")
    for rank, per_case in enumerate(measured()):
        kept = per_case[case][1]
        assert planned == pytest.approx(kept, rel=0.02), f"rank {rank}: kept {kept}, planned {planned}"
