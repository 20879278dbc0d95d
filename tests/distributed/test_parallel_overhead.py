"""benchmarks/parallel_overhead.py keeps running, and its bytes-sent counters agree with theory.

One 2-process run of the benchmark's every mode at tiny sizes, one timed step per side (no timing checks).
The counters use the ring model of ``collectives.ring_bytes_sent``: an all-reduce of ``n`` bytes over ``w``
ranks sends ``2 n (w - 1) / w`` per rank, an all-gather or reduce-scatter ``n (w - 1) / w``.
"""

from __future__ import annotations

import os
import re
import sys

import pytest

from tests.distributed.harness import run_distributed

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import parallel_overhead as bench  # noqa: E402

TINY = bench.Sizes(layers=4, hidden=32, heads=2, seq=16, vocab=256, global_batch=8)
WORLD = 2
# Besides the gradients, a data-parallel step all-reduces a few scalars: the grad norm (both sides) and
# our logged loss average. Each is 4 bytes, 2 x 4 x (w-1)/w = 4 bytes sent.
SCALARS = 64


@pytest.fixture(scope="module")
def figures() -> dict[str, dict]:
    return run_distributed(bench.run_modes, WORLD, list(bench.MODES), TINY, 1, timeout=600)[0]


def test_every_mode_runs_both_sides_and_reports_figures(figures):
    for mode in bench.MODES:
        result = figures[mode]
        for side in ("ours", "peer"):
            assert len(result["times"][side]) == 1, (mode, side)
            assert result["peak"][side] > 4 * result["params"] // WORLD, (mode, side)  # at least the shards
            assert result["sent"][side] > 0, (mode, side)


def test_dp_sends_one_gradient_all_reduce_per_step(figures):
    """dp and DDP all-reduce 2 x parameter bytes x (dp-1)/dp, plus a few scalars; DDP also broadcasts the
    model's buffers each forward (a few hundred bytes)."""
    dp = figures["dp"]
    theory = 2 * 4 * dp["params"] * (WORLD - 1) // WORLD
    for side in ("ours", "peer"):
        by_kind = dp["sent_by_kind"][side]
        assert theory <= by_kind["all_reduce"] <= theory + SCALARS, (side, by_kind, theory)
        assert dp["sent"][side] - by_kind["all_reduce"] < 0.01 * theory, (side, by_kind)


@pytest.mark.parametrize("mode", ["zero1", "zero2"])
def test_zero12_sends_one_reduce_scatter_and_one_all_gather(figures, mode):
    """ZeRO-1/2 reduce-scatter the gradient and all-gather the updated params: 2 x, as dp's all-reduce
    (with ``--overlap-param-gather`` a step's forward launches the previous update's gathers and its end the
    first unit's of its own: still one of each per step)."""
    result = figures[mode]
    one_pass = 4 * result["params"] * (WORLD - 1) // WORLD
    sent = result["sent_by_kind"]["ours"]
    assert sent["reduce_scatter"] == pytest.approx(one_pass, rel=0.01), sent
    assert sent["all_gather"] == pytest.approx(one_pass, rel=0.01), sent
    assert result["sent"]["ours"] <= bench.theory_bytes(mode, TINY, result["params"], WORLD) * 1.01 + SCALARS


@pytest.mark.parametrize("mode", ["zero3", "zero3-prefetch"])
def test_zero3_sends_gather_gather_reduce_scatter(figures, mode):
    """ZeRO-3: parameters all-gathered for forward and again for backward, gradients reduce-scattered: 3x,
    less the root's second gather (kept gathered from forward into its backward, as FSDP2 does)."""
    zero3 = figures[mode]
    one_pass = 4 * zero3["params"] * (WORLD - 1) // WORLD
    root = 4 * zero3["root_params"] * (WORLD - 1) // WORLD
    sent = zero3["sent_by_kind"]["ours"]
    assert sent["all_gather"] == pytest.approx(2 * one_pass - root, rel=0.01), sent
    assert sent["reduce_scatter"] == pytest.approx(one_pass, rel=0.01), sent


@pytest.mark.parametrize("mode, boundaries", [("pp", 1), ("pp-interleaved", 3), ("pp-zb-h1", 1), ("pp-zb-v", 2),
                                              ("pp-dualpipev", 2)])
def test_pipeline_sends_each_micro_batch_activation_once_per_stage_boundary(figures, mode, boundaries):
    """With v chunks per rank over 2 ranks on the ring there are 2v - 1 stage boundaries between the ranks; on the
    V (two chunks per rank) 2 of its 3 (the middle one is inside rank 1). Each rank sends, per micro batch, the
    activations ``[s, 1, h]`` (forward) or their gradients (backward) of each of them."""
    activation = TINY.seq * TINY.hidden * 4
    theory = boundaries * TINY.global_batch * activation
    for side in ("ours", "peer"):
        sent = figures[mode]["sent"][side]
        assert theory <= sent <= theory + SCALARS, (mode, side, figures[mode]["sent_by_kind"][side], theory)


def _flat_collectives_on_gloo(rank: int, world: int) -> dict:
    """``collectives.reduce_scatter_flat`` / ``all_gather_flat`` (ZeRO's) on gloo, async and in place as the
    buffers call them: their results against torch's own, and the c10d ops they ran."""
    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron_like import collectives as comm

    class ops_seen(TorchDispatchMode):  # noqa: N801
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            if func.namespace == "c10d":
                self.names.append(func._overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    dist.init_process_group("gloo")
    group = dist.new_group(list(range(world)))
    gradient = torch.randn(world * 1000, generator=torch.Generator().manual_seed(rank))
    expected = gradient.clone()
    dist.all_reduce(expected, group=group)
    shard = gradient.view(world, -1)[rank]  # in place, as the buffers reduce
    params = torch.zeros(world * 1000)
    with ops_seen() as seen:
        comm.reduce_scatter_flat(shard, gradient, group, async_op=True).wait()
        params.view(world, -1)[rank] = shard
        comm.all_gather_flat(params, params.view(world, -1)[rank], group, async_op=True).wait()
    return {"shard_error": float((shard - expected.view(world, -1)[rank]).abs().max()),
            "params_error": float((params - expected).abs().max()), "ops": seen.names}


def test_zero_flat_collectives_on_gloo_avoid_torchs_full_size_copies():
    """gloo has no reduce-scatter (torch's clones the input and all-reduces it) and its all-gather goes through
    an output-sized temporary: ZeRO's flat collectives run point-to-point sends and receives of the other ranks'
    chunks and in-place broadcasts instead, and give torch's results (docs/distributed.md)."""
    for result in run_distributed(_flat_collectives_on_gloo, WORLD):
        assert result["shard_error"] < 1e-6 and result["params_error"] < 1e-6, result
        assert set(result["ops"]) == {"send", "recv_", "broadcast_"}, result["ops"]


def test_states_dominate_preset_is_dominated_by_states():
    """``--states-dominate`` is where issue 16 reads "ZeRO-3 at most 60% of dp's peak": by the planner, dp's
    params, fp32 gradients and Adam moments must outweigh the step's activations by 10x there (at the issue sizes
    the logits dominate instead)."""
    from megatron_like.planning.simulator import plan_run

    sizes = bench.STATES_DOMINATE
    config = bench.our_config("dp", sizes, WORLD)
    rank = plan_run(config, config.padded_vocab_size(sizes.vocab), device="cpu").ranks[0]
    states = rank.weight_bytes + rank.grad_bytes + rank.optimizer_bytes
    assert states == 16 * rank.params
    assert states >= 10 * rank.activations.total, (states / 2**20, rank.activations.total / 2**20)


def test_floor_runs_in_data_parallel_modes_and_communicates_nothing(figures):
    """The floor (no data parallelism) is timed beside both sides of every data-parallel mode, holds the whole
    model's states and sends nothing; tp and pp have no floor row."""
    for mode in bench.MODES:
        result = figures[mode]
        if mode not in bench.DATA_PARALLEL_MODES:
            assert "floor" not in result["times"], mode
            continue
        assert len(result["times"]["floor"]) == 1, mode
        assert result["sent"]["floor"] == 0, mode
        assert result["peak"]["floor"] > 4 * 4 * result["params"], mode  # params, grads, two Adam moments
        rows = bench.table(mode, TINY, [result], WORLD)
        assert [row.split(" | ")[1] for row in rows] == ["megatron_like", bench.PEERS[mode][0], bench.FLOOR]


def test_zero_bubble_modes_time_our_1f1b_on_the_same_model(figures):
    """Each zero-bubble mode also times our 1F1B on its model (the gain over 1F1B is read from one alternation):
    that side sends what the pp mode's 1F1B sends, and the comment line gives both sides' ratio to it."""
    for mode in bench.ZERO_BUBBLE_MODES:
        result = figures[mode]
        assert result["sent"]["1f1b"] == figures["pp"]["sent"]["ours"], mode
        line = bench.gain_over_one_f_one_b(mode, [result])
        assert line.startswith(f"# {mode}: vs megatron_like 1F1B") and len(re.findall(r"\d\.\d{3}x", line)) == 4, line
    assert "1f1b" not in figures["pp"]["times"]


def test_compute_dominates_preset_keeps_the_output_layer_small_and_modes_are_checked_first(capsys):
    """``--compute-dominates`` is where the zero-bubble speed is read: the output layer is at most 5% of a pp 2
    stage's parameters (4 layers), as GPT-3 175B's is of its stages; a mode the chosen sizes cannot run fails
    before any process starts, naming the rule."""
    sizes = bench.COMPUTE_DOMINATES
    layer = 12 * sizes.hidden ** 2
    assert sizes.vocab * sizes.hidden <= 0.05 * layer * sizes.layers / 2
    assert sizes.layers % 4 == 0  # every pp mode, the V's two chunks per rank included, runs the same 8 layers
    with pytest.raises(SystemExit):
        bench.main(["--issue-sizes", "--modes", "pp-zb-v"])
    assert "--modes pp-zb-v at Sizes(layers=6" in capsys.readouterr().err
