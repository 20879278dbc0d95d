"""What sequence parallelism keeps for backward at tp 2: only the sequence shard of a column-parallel linear's
input (gathered again in backward, ``tensor_parallel/sequence_parallel_linear.py``), and a transformer layer's
saved bytes against the planner's per-layer formula (``planning/activations.py``)."""

from __future__ import annotations

import pytest

from tests.distributed.harness import run_distributed
from tests.saved_tensors import kept_for_backward
from tests.unit.test_plan import LAYER, LLAMA, MLA, MLA_CASES

TP = 2
SP = ["--tensor-model-parallel-size", str(TP), "--sequence-parallel"]
CASES = {"gpt": [], "llama": LLAMA, "mla": MLA, "mla-no-q-latent-moe": MLA_CASES["mla-no-q-latent-moe"]}
ZERO_BUBBLE = ("gpt", "mla", "mla-no-q-latent-moe")
"""Cases also measured inside a zero-bubble run's forward, whose column-parallel linears keep the gathered input."""


def parsed(case: str, zero_bubble: bool = False):
    """The config of ``case`` at tp 2 with sequence parallelism (a one-stage config told it runs ZB-H1's split
    backward: the schedule itself needs two stages)."""
    from megatron_like.config import parse_config

    config = parse_config(LAYER + CASES[case] + SP, world_size=TP)
    if zero_bubble:
        config.parallel.pipeline_schedule = "zb-h1"
    return config


def saved_shapes_of_column_linear(ps) -> list[tuple[int, ...]]:
    """Shapes of the non-parameter tensors a sequence-parallel ColumnParallelLinear ``16 -> 24`` saves for backward
    on this rank's ``[8 / tp, 2, 16]`` shard."""
    import torch

    from megatron_like.tensor_parallel import ColumnParallelLinear, normal_init

    linear = ColumnParallelLinear(16, 24, tp_group=ps.tp_group, init_method=normal_init(0.5), seed=3, name="col",
                                  sequence_parallel=True)
    params = {p.data_ptr() for p in linear.parameters()}
    shapes = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.data_ptr() not in params:
            shapes.append(tuple(tensor.shape))
        return tensor

    x = torch.randn(8 // TP, 2, 16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        linear(x).sum().backward()
    return shapes


def measure(rank: int, world_size: int) -> dict:
    """The column linear's saved shapes and each case's layer bytes (saved-tensor hooks) on this tp rank."""
    from megatron_like.parallel_state import ParallelState
    from megatron_like.tensor_parallel.weight_grad import split_backward

    ps = ParallelState.initialize(parsed("gpt").parallel, world_size)
    layers = {name: kept_for_backward(parsed(name), ps=ps) for name in CASES}
    with split_backward():
        zero_bubble = {name: kept_for_backward(parsed(name, True), ps=ps) for name in ZERO_BUBBLE}
    return {"column": saved_shapes_of_column_linear(ps), "layers": layers, "zero_bubble": zero_bubble}


@pytest.fixture(scope="module")
def measured() -> list[dict]:
    return run_distributed(measure, TP)


def test_column_parallel_linear_keeps_only_its_sequence_shard(measured):
    """The input saved for the weight gradient is the ``[s / tp, b, h]`` shard, not the gathered ``[s, b, h]``."""
    for rank in measured:
        assert rank["column"] == [(8 // TP, 2, 16)], rank["column"]


@pytest.mark.parametrize("case", list(CASES))
def test_layer_activation_formula_equals_the_saved_tensors_at_tp2_sequence_parallel(measured, case):
    """One layer's saved bytes on each tp rank against the planner's formula at tp 2 with sequence parallelism:
    the norms' and the column-parallel linears' inputs divided by tp, the heads' and the MLP's terms split."""
    from megatron_like.planning.activations import layer_activation_bytes

    planned = layer_activation_bytes(parsed(case), None, "cpu")
    for rank in measured:
        assert planned == pytest.approx(rank["layers"][case], rel=0.02)


@pytest.mark.parametrize("case", ZERO_BUBBLE)
def test_zero_bubble_layer_keeps_the_gathered_inputs_the_planner_counts(measured, case):
    """Inside a zero-bubble run the column-parallel linears' W steps keep their gathered inputs: more than the
    other schedules, as the planner's ``gathered_for_w_steps`` counts."""
    from megatron_like.planning.activations import layer_activation_bytes

    planned = layer_activation_bytes(parsed(case, zero_bubble=True), None, "cpu")
    for rank in measured:
        assert rank["zero_bubble"][case] > rank["layers"][case]
        assert planned == pytest.approx(rank["zero_bubble"][case], rel=0.02)
