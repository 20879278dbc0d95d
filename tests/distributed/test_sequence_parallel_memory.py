"""What sequence parallelism keeps for backward at tp 2: only the sequence shard of a column-parallel linear's
input (gathered again in backward, ``tensor_parallel/sequence_parallel_linear.py``), and a transformer layer's
saved bytes against the planner's per-layer formula (``planning/activations.py``). Inside a zero-bubble run
(``weight_grad.split_backward``): what a B step leaves for its W (the W stash) holds the shards by default and the
gathered tensors with --keep-gathered-sequence-for-wgrad, each as the planner counts it
(``planning/split_backward.py``), and B then W give the plain backward's gradients under both choices."""

from __future__ import annotations

import pytest

from tests.distributed.harness import run_distributed
from tests.saved_tensors import kept_for_backward, kept_for_weight_grads, layer_and_input
from tests.unit.test_plan import LAYER, LLAMA, MLA, MLA_CASES

TP = 2
SP = ["--tensor-model-parallel-size", str(TP), "--sequence-parallel"]
CASES = {"gpt": [], "llama": LLAMA, "mla": MLA, "mla-no-q-latent-moe": MLA_CASES["mla-no-q-latent-moe"]}
ZERO_BUBBLE = ("gpt", "mla", "mla-no-q-latent-moe")
"""Cases also measured inside a zero-bubble run, under both choices."""
CHOICES = {"re-gather": False, "keep": True}
"""--keep-gathered-sequence-for-wgrad off (the default) and on."""


def parsed(case: str, zero_bubble: bool = False, keep_gathered: bool = False):
    """The config of ``case`` at tp 2 with sequence parallelism (a one-stage config told it runs ZB-H1's split
    backward: the schedule itself needs two stages)."""
    from megatron_like.config import parse_config

    config = parse_config(LAYER + CASES[case] + SP, world_size=TP)
    if zero_bubble:
        config.parallel.pipeline_schedule = "zb-h1"
        config.parallel.keep_gathered_sequence_for_wgrad = keep_gathered
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


def split_linear_stash_and_grads(ps, keep_gathered: bool) -> dict:
    """A sequence-parallel column linear ``16 -> 24`` (bias) feeding a row linear ``24 -> 16`` on this rank's ``[8 /
    tp, 2, 16]`` shard: each one's W stash bytes (``WeightGradWork.kept_bytes`` of a B step through it alone), and
    the input and parameter gradients of the two after B and W, and after a plain backward."""
    import torch

    from megatron_like.tensor_parallel import ColumnParallelLinear, RowParallelLinear, normal_init, weight_grad

    column = ColumnParallelLinear(16, 24, tp_group=ps.tp_group, init_method=normal_init(0.5), seed=3, name="col",
                                  sequence_parallel=True)
    row = RowParallelLinear(24, 16, tp_group=ps.tp_group, init_method=normal_init(0.5), seed=3, name="row",
                            bias=False, sequence_parallel=True)
    params = [*column.parameters(), *row.parameters()]
    torch.manual_seed(11 + ps.tp_rank)
    x = torch.randn(8 // TP, 2, 16, requires_grad=True)
    out_grad = torch.randn(8 // TP, 2, 16)

    def gradients() -> list[torch.Tensor]:
        grads = [x.grad.clone(), *(p.grad.clone() for p in params)]
        x.grad = None
        for p in params:
            p.grad = None
        return grads

    stash = {}
    with weight_grad.split_backward(keep_gathered):
        for name, layer, layer_input, grad in (("column", column, x.detach().requires_grad_(),
                                                torch.randn(8, 2, 24 // TP)),
                                               ("row", row, torch.randn(8, 2, 24 // TP, requires_grad=True),
                                                out_grad)):
            with weight_grad.deferring_weight_grads(list(layer.parameters())) as work:
                layer(layer_input).backward(grad)
            stash[name] = work.kept_bytes
        y = row(column(x))
        with weight_grad.deferring_weight_grads(params) as work:
            y.backward(out_grad)
        work.run()
        split = gradients()
    row(column(x)).backward(out_grad)
    return {"stash": stash, "split": split, "plain": gradients()}


def split_layer_grads(config, ps) -> dict:
    """One TransformerLayer's input and parameter gradients on this tp rank after B and W in a zero-bubble run
    under ``config``'s choice, and after a plain backward (the same layer, input and output gradient)."""
    import torch

    from megatron_like.tensor_parallel import weight_grad

    layer, x = layer_and_input(config, ps)
    params = list(layer.parameters())
    out_grad = torch.randn_like(x)
    with weight_grad.split_backward(config.parallel.keep_gathered_sequence_for_wgrad):
        y = layer(x)
        with weight_grad.deferring_weight_grads(params) as work:
            y.backward(out_grad)
        work.run()
    split = [x.grad.clone(), *(p.grad.clone() for p in params)]
    x.grad = None
    layer.zero_grad(set_to_none=True)
    layer(x).backward(out_grad)
    return {"split": split, "plain": [x.grad, *(p.grad for p in params)]}


def measure(rank: int, world_size: int) -> dict:
    """The column linear's saved shapes and each case's layer bytes (saved-tensor hooks) on this tp rank; inside a
    zero-bubble run under each choice: the layer bytes, the W stash bytes, the split linears' stashes and
    gradients, and a GPT layer's gradients (each against a plain backward)."""
    from megatron_like.parallel_state import ParallelState
    from megatron_like.tensor_parallel.weight_grad import split_backward

    ps = ParallelState.initialize(parsed("gpt").parallel, world_size)
    layers = {name: kept_for_backward(parsed(name), ps=ps) for name in CASES}
    zero_bubble, stash, linears, layer_grads = {}, {}, {}, {}
    for choice, keep in CHOICES.items():
        with split_backward(keep):
            zero_bubble[choice] = {name: kept_for_backward(parsed(name, True, keep), ps=ps) for name in ZERO_BUBBLE}
        stash[choice] = {name: kept_for_weight_grads(parsed(name, True, keep), ps, keep) for name in ZERO_BUBBLE}
        linears[choice] = split_linear_stash_and_grads(ps, keep)
        layer_grads[choice] = split_layer_grads(parsed("gpt", True, keep), ps)
    return {"column": saved_shapes_of_column_linear(ps), "layers": layers, "zero_bubble": zero_bubble,
            "stash": stash, "linears": linears, "layer_grads": layer_grads}


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


@pytest.mark.parametrize("choice", CHOICES)
@pytest.mark.parametrize("case", ZERO_BUBBLE)
def test_zero_bubble_layer_keeps_what_the_planner_counts(measured, case, choice):
    """Inside a zero-bubble run a layer keeps from its forward no more than the other schedules keep (the
    column-parallel linears' input shards), or with --keep-gathered-sequence-for-wgrad the gathered inputs too, as
    the planner's ``gathered_for_w_steps`` counts."""
    from megatron_like.planning.activations import layer_activation_bytes

    planned = layer_activation_bytes(parsed(case, True, CHOICES[choice]), None, "cpu")
    for rank in measured:
        if CHOICES[choice]:
            assert rank["zero_bubble"][choice][case] > rank["layers"][case]
        else:  # (the MoE case's split ops save a little less than the plain ones)
            assert rank["zero_bubble"][choice][case] <= rank["layers"][case]
        assert planned == pytest.approx(rank["zero_bubble"][choice][case], rel=0.02)


@pytest.mark.parametrize("choice", CHOICES)
@pytest.mark.parametrize("case", ZERO_BUBBLE)
def test_w_stash_at_tp2_sequence_parallel_is_the_planners(measured, case, choice):
    """What a layer's B leaves for its W at tp 2 with sequence parallelism against ``layer_stash``: the shards of the
    column-parallel inputs and the row-parallel output gradients by default, the gathered ones when kept."""
    from megatron_like.planning.split_backward import layer_stash

    planned = layer_stash(parsed(case, True, CHOICES[choice])).total
    for rank in measured:
        assert planned == pytest.approx(rank["stash"][choice][case], rel=0.02)


@pytest.mark.parametrize("choice", CHOICES)
def test_split_linears_keep_the_shard_for_w_and_give_the_plain_gradients(measured, choice):
    """The W stash of a split sequence-parallel column linear ``16 -> 24`` is its input's ``[8 / tp, 2, 16]`` shard
    and its ``[8, 2, 24 / tp]`` output gradient (the gathered ``[8, 2, 16]`` input when kept); a row linear's is its
    ``[8, 2, 24 / tp]`` input and its output gradient's ``[8 / tp, 2, 16]`` shard (gathered ``[8, 2, 16]`` when kept).
    B then W give the plain backward's input and weight gradients either way."""
    import torch

    gathered = CHOICES[choice]
    sequence = 8 if gathered else 8 // TP
    expected = {"column": 4 * (sequence * 2 * 16 + 8 * 2 * 24 // TP), "row": 4 * (8 * 2 * 24 // TP + sequence * 2 * 16)}
    for rank in measured:
        linears = rank["linears"][choice]
        assert linears["stash"] == expected
        for split, plain in zip(linears["split"], linears["plain"]):
            torch.testing.assert_close(split, plain, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("choice", CHOICES)
def test_split_layer_gives_the_plain_gradients_on_every_tp_rank(measured, choice):
    """A GPT layer's B then W at tp 2 with sequence parallelism give the plain backward's gradients: its W steps'
    all-gathers (QKV's and fc1's inputs, the projections' output gradients) pair up across the tp ranks."""
    import torch

    for rank in measured:
        grads = rank["layer_grads"][choice]
        for split, plain in zip(grads["split"], grads["plain"]):
            torch.testing.assert_close(split, plain, rtol=1e-5, atol=1e-6)
