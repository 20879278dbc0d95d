"""``--overlap-param-gather``: parameter all-gathers are launched one unit ahead of the compute that needs them.

On 2 gloo processes the order of events of one training step is recorded: each asynchronous all-gather's
launch (named by the unit whose ``param_flat`` it fills), each unit's forward start (a forward pre-hook
registered after the data-parallel ones) and each gradient arriving (backward progress). With prefetch:

* ZeRO-3 forward: unit ``i + 1``'s gather is launched before unit ``i`` computes (root, layer 0, 1, ...);
* ZeRO-3 backward: unit ``i - 1``'s gather is launched before unit ``i``'s first gradient (root, layer 3, ...);
* ZeRO-1/2: the updated params are gathered during the next forward, each layer's launched before the
  previous layer computes (without the flag every gather happens inside the optimizer step).

Without prefetch each gather is launched by the hook of its own unit, after the previous unit computed, and
these checks fail. Losses and weights with the flag equal one process's (``test_zero.py``); the memory cost
(one more layer's gathered params) is checked against the planner in ``test_zero_memory.py``.
"""

from __future__ import annotations

import functools

import pytest

from megatron_like.config import parse_config
from tests.distributed.gpt_runs import BASE_FLAGS
from tests.distributed.harness import run_distributed

FLAGS = BASE_FLAGS + ["--train-iters", "2", "--overlap-param-gather"]
STAGES = (1, 2, 3)
LAYERS = 4  # BASE_FLAGS' --num-layers


def gather_timeline(flags: list[str], world_size: int) -> list[tuple[str, str]]:
    """Train ``flags``; the events of the first micro batch of the last step: ``("launch", unit)``,
    ``("forward", unit)``, ``("grad", unit)`` with unit ``root`` or ``layerN``."""
    import pretrain_gpt
    from megatron_like import collectives as comm
    from megatron_like.parallel_state import ParallelState
    from megatron_like.training import pretrain

    config = parse_config(flags, world_size=world_size)
    events: list[tuple[str, str]] = []
    unit_of_output: dict[int, str] = {}  # id(bucket.param_flat) -> unit name
    recording = False

    original = comm.all_gather_flat

    def logged(output, tensor, group, async_op: bool = False):  # noqa: ANN001, ANN202 - collectives' signature
        if recording and async_op and id(output) in unit_of_output:
            events.append(("launch", unit_of_output[id(output)]))
        return original(output, tensor, group, async_op=async_op)

    def record(kind: str, name: str, *_: object) -> None:  # a hook: returns None (a pre-hook's value replaces
        if recording:  # the module's input)
            events.append((kind, name))

    calls = 0

    def forward_step(data_iterator, model):  # noqa: ANN001, ANN202 - pretrain_gpt.forward_step's signature
        nonlocal calls, recording
        if calls == 0:  # the data-parallel hooks exist now: these run after them
            for module, buckets in model.param_and_grad_buffer.units:
                name = "root" if module is model else f"layer{module.layer}"
                for bucket in buckets:
                    unit_of_output[id(bucket.param_flat)] = name
                module.register_forward_pre_hook(functools.partial(record, "forward", name))
                for param in (p for b in buckets for p in b.params):
                    param.register_post_accumulate_grad_hook(functools.partial(record, "grad", name))
        # The last step's first micro batch; at ZeRO-1/2 the root's gather was launched by the step before.
        recording = calls == (config.training.train_iters - 1) * config.num_microbatches
        calls += 1
        return pretrain_gpt.forward_step(data_iterator, model)

    comm.all_gather_flat = logged
    try:
        ps = ParallelState.initialize(config.parallel, world_size)
        vocab = config.padded_vocab_size(config.model.vocab_size)
        provider = functools.partial(pretrain_gpt.model_provider, padded_vocab_size=vocab)
        pretrain(config, provider, forward_step, pretrain_gpt.datasets_provider, ps=ps, padded_vocab_size=vocab)
    finally:
        comm.all_gather_flat = original
    return events


def timeline_worker(rank: int, world_size: int) -> dict[int, list[tuple[str, str]]]:
    return {stage: gather_timeline(FLAGS + ["--zero-stage", str(stage)], world_size) for stage in STAGES}


@functools.cache
def timelines() -> list[dict[int, list[tuple[str, str]]]]:
    return run_distributed(timeline_worker, 2)


def first(events: list[tuple[str, str]], event: tuple[str, str], start: int = 0) -> int:
    """Index of the first ``event`` at or after ``start``; len(events) if none."""
    return next((i for i in range(start, len(events)) if events[i] == event), len(events))


FORWARD_ORDER = ["root"] + [f"layer{i}" for i in range(LAYERS)]
BACKWARD_ORDER = ["root"] + [f"layer{i}" for i in reversed(range(LAYERS))]


@pytest.mark.parametrize("stage", STAGES)
def test_next_units_gather_is_launched_before_this_unit_computes_in_forward(stage: int) -> None:
    for rank, per_stage in enumerate(timelines()):
        events = per_stage[stage]
        for unit, following in zip(FORWARD_ORDER, FORWARD_ORDER[1:]):
            launched, computes = first(events, ("launch", following)), first(events, ("forward", unit))
            assert computes < len(events), f"zero {stage} rank {rank}: {unit} never ran forward: {events}"
            assert launched < computes, \
                f"zero {stage} rank {rank}: {following}'s gather was not launched before {unit}'s forward: {events}"


def test_next_units_gather_is_launched_before_this_unit_computes_in_backward() -> None:
    for rank, per_stage in enumerate(timelines()):
        events = per_stage[3]
        backward = max(i for i, (kind, _) in enumerate(events[:first(events, ("grad", "root"))]) if kind == "forward")
        for unit, following in zip(BACKWARD_ORDER, BACKWARD_ORDER[1:]):
            launched = first(events, ("launch", following), backward)
            computes = first(events, ("grad", unit), backward)
            assert computes < len(events), f"rank {rank}: {unit} got no gradient: {events}"
            assert launched < computes, \
                f"rank {rank}: {following}'s gather was not launched before {unit}'s backward: {events}"
