"""ZeRO's gloo reduce-scatter (``collectives.reduce_scatter_flat``) against a plain sum, on 2 and 4 ranks.

gloo has no reduce-scatter of its own: ours sends chunk j of the input to rank j and receives the other ranks'
chunks of its own part, ``(w - 1)`` chunks, then sums them with its own chunk into the output, in place when the
output is that chunk (how ``distributed/buffers.py`` calls it). Checked on one process group per world size:

* results, synchronous and asynchronous, in place and into a separate output, with ranks' values of different
  magnitudes and an odd chunk length, against the float64 sum of every rank's input (each rank rebuilds all
  inputs from their seeds);
* two reduce-scatters in flight at once on one group, beside the asynchronous in-place all-gather broadcasts that
  ``--overlap-param-gather`` runs at the same time: each lands where it belongs;
* memory: the only tensor a reduce-scatter allocates is its receive buffer, ``(w - 1) / w`` of the input's bytes,
  freed by the wait on the caller's thread (the all-to-all it replaced received a buffer as large as the input).
"""

from __future__ import annotations

import functools

import pytest

from tests.distributed.harness import run_distributed

CHUNK = 1001  # elements per rank: odd, so no case relies on an aligned split
MEMORY_CHUNK = 1 << 16


def _inputs(world: int, case: int) -> list:
    """Every rank's input ``[world * CHUNK]`` for one case: rank r's values scaled by ``10 ** r`` (uneven)."""
    import torch

    return [torch.randn(world * CHUNK, generator=torch.Generator().manual_seed(100 * case + r)) * 10.0 ** r
            for r in range(world)]


def _cases(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from megatron_like import collectives as comm

    dist.init_process_group("gloo")
    group = dist.new_group(list(range(world)))
    errors: dict[str, float] = {}

    def check(name: str, case: int, result: torch.Tensor) -> None:
        inputs = torch.stack([t.double() for t in _inputs(world, case)])[:, rank * CHUNK : (rank + 1) * CHUNK]
        # float32 rounding of each partial sum is relative to the magnitudes summed, not to the (cancelling) total
        errors[name] = float(((result.double() - inputs.sum(0)).abs() / inputs.abs().sum(0)).max())

    for case, (in_place, async_op) in enumerate([(False, False), (False, True), (True, False), (True, True)]):
        tensor = _inputs(world, case)[rank].clone()
        output = tensor.view(world, -1)[rank] if in_place else torch.full((CHUNK,), float("nan"))
        work = comm.reduce_scatter_flat(output, tensor, group, async_op=async_op)
        assert (work is not None) == async_op
        if work is not None:
            work.wait()
        check(f"in_place={in_place} async={async_op}", case, output)

    # Two reductions in flight with the param all-gather's broadcasts between them (--overlap-param-gather).
    first, second = _inputs(world, 10)[rank].clone(), _inputs(world, 11)[rank].clone()
    params = torch.zeros(world * CHUNK)
    params.view(world, -1)[rank] = rank + 1.0
    works = [comm.reduce_scatter_flat(first.view(world, -1)[rank], first, group, async_op=True),
             comm.all_gather_flat(params, params.view(world, -1)[rank], group, async_op=True),
             comm.reduce_scatter_flat(second.view(world, -1)[rank], second, group, async_op=True)]
    for work in works:
        work.wait()
    check("two in flight, first", 10, first.view(world, -1)[rank])
    check("two in flight, second", 11, second.view(world, -1)[rank])
    gathered_ok = bool((params.view(world, -1) == torch.arange(1.0, world + 1).unsqueeze(1)).all())

    # Memory: live bytes the in-place reduce-scatter adds at its peak, and after its wait.
    gradient = torch.randn(world * MEMORY_CHUNK)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        comm.reduce_scatter_flat(gradient.view(world, -1)[rank], gradient, group, async_op=True).wait()
    alive = peak = 0
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    for event in sorted(events, key=lambda e: e.start_ns()):
        alive += event.nbytes()
        peak = max(peak, alive)
    return {"errors": errors, "gathered_ok": gathered_ok, "peak_bytes": peak, "end_bytes": alive,
            "input_bytes": gradient.numel() * gradient.element_size()}


@functools.cache
def results(world: int) -> list[dict]:
    return run_distributed(_cases, world)


@pytest.mark.parametrize("world", [2, 4])
def test_reduce_scatter_flat_matches_a_plain_sum(world: int) -> None:
    for rank, result in enumerate(results(world)):
        assert len(result["errors"]) == 6, result["errors"]
        for name, error in result["errors"].items():
            assert error < 1e-6, f"rank {rank} of {world}, {name}: relative error {error:.2e}"
        assert result["gathered_ok"], f"rank {rank} of {world}: the all-gather between the reductions went wrong"


@pytest.mark.parametrize("world", [2, 4])
def test_reduce_scatter_flat_allocates_only_the_other_ranks_chunks(world: int) -> None:
    """In place, the receive buffer ``[(w - 1), n]`` is all a reduce-scatter allocates, and the wait frees it."""
    for rank, result in enumerate(results(world)):
        theory = result["input_bytes"] * (world - 1) // world
        assert result["peak_bytes"] == theory, \
            f"rank {rank} of {world}: peak {result['peak_bytes']} bytes alive, theory {theory}"
        assert result["end_bytes"] == 0, f"rank {rank} of {world}: {result['end_bytes']} bytes left alive"
