"""ZeRO-3 start-up memory: building the model and sharding it holds this rank's shard plus one unit, never
the unsharded pipeline stage; and the deferred build draws exactly (bitwise) the weights an eager build draws.

Measured as the peak bytes of live tensors (the profiler's allocation log, as ``tests/unit/test_plan.py``)
from the first parameter made to the last bucket sharded (``build_model_chunks`` + ``DataParallel``), on two
processes, for three layouts: bf16 sharded over dp 2; tp 2 and pp 2 with two virtual chunks (dp 1 there: the
"shard" is the whole stage, and the point is that it is not held twice; these two cover tensor-parallel
slices, several chunks and the last stage's tied embedding copy bitwise). The bound, from the run's buffers::

    shard  (this rank's persistent param and fp32 grad shards: the buffers' param_data + grad_data)
  + unit   (the largest bucket, in the param dtype: one unit's gather buffer, what each unit is drawn into)
  + draw   (the fp32 scratch holding one full weight while its tp slice is cut out; the test model's weights
            are all smaller than one draw chunk, so it is the largest full weight)

Nothing else is allocated while building. The old path (the stage built eagerly, then sharded) is measured too
and must exceed the bound, so the bound is tight enough to tell the two apart.
"""

from __future__ import annotations

import copy
import functools

import torch

from tests.distributed.gpt_runs import BASE_FLAGS
from tests.distributed.harness import run_distributed
from tests.peak_memory import peak_live_bytes

LAYOUTS = {
    "dp2-bf16": ["--bf16"],
    "tp2": ["--tensor-model-parallel-size", "2"],
    "pp2-vp2": ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2"],
}
FLAGS = ["--num-layers", "8", "--zero-stage", "3"]


def local_values(model: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """This rank's parameters (its tp slices, the last stage's tied embedding copy included), by chunk and name."""
    from megatron_like.distributed import gathered_parameters

    with gathered_parameters(model):
        return {f"{i}.{name}": param.detach().clone()
                for i, chunk in enumerate(model) for name, param in chunk.named_parameters()}


def startup_worker(rank: int, world_size: int) -> dict[str, dict]:
    """Per layout: the start-up peak of the deferred and the eager build, the bound's terms, and the names of
    parameters whose values differ between the two builds."""
    import pretrain_gpt
    from megatron_like.config import parse_config
    from megatron_like.distributed import DataParallel
    from megatron_like.distributed.memory import measured_state_bytes
    from megatron_like.parallel_state import ParallelState
    from megatron_like.tensor_parallel.initialization import DRAW_CHUNK_ELEMENTS
    from megatron_like.training.loop import build_model_chunks

    out = {}
    for name, flags in LAYOUTS.items():
        config = parse_config(BASE_FLAGS + FLAGS + flags, world_size=world_size)
        ps = ParallelState.initialize(config.parallel, world_size)
        provider = functools.partial(pretrain_gpt.model_provider,
                                     padded_vocab_size=config.padded_vocab_size(config.model.vocab_size))

        def build(build_config):
            model = build_model_chunks(build_config, ps, provider)
            return model, DataParallel(model, ps, zero_stage=3)

        peak, (model, data_parallel) = peak_live_bytes(lambda: build(config))
        # The old path: the same chunks built eagerly (what build_model_chunks does below ZeRO-3), then sharded.
        eager_config = copy.deepcopy(config)
        eager_config.parallel.zero_stage = 0
        eager_peak, (eager_model, _) = peak_live_bytes(lambda: build(eager_config))

        state = measured_state_bytes(data_parallel)
        unit = max(b.numel * b.param_flat.element_size() for b in data_parallel.buckets())
        params = [p for chunk in model for p in chunk.parameters()]
        full_numels = [p.numel() * (ps.tp_size if getattr(p, "tensor_model_parallel", False) else 1) for p in params]
        assert max(full_numels) <= DRAW_CHUNK_ELEMENTS  # so the draw scratch is one whole weight
        deferred, eager = local_values(model), local_values(eager_model)
        out[name] = {
            "peak": peak, "eager_peak": eager_peak, "shard": state.params + state.grads, "unit": unit,
            "draw": 4 * max(full_numels),
            "differ": [n for n in eager if not torch.equal(deferred[n], eager[n])],
        }
    return out


@functools.cache
def startup_results() -> list[dict[str, dict]]:
    return run_distributed(startup_worker, 2)


def test_zero3_startup_peak_is_shard_plus_one_unit_and_weights_are_unchanged() -> None:
    for rank, results in enumerate(startup_results()):
        for name, r in results.items():
            where = f"rank {rank}, {name}"
            assert r["differ"] == [], f"{where}: deferred build draws other values for {r['differ']}"
            bound = r["shard"] + r["unit"] + r["draw"]
            assert r["peak"] <= bound, f"{where}: start-up peak {r['peak']} B > shard {r['shard']} + unit " \
                                       f"{r['unit']} + draw {r['draw']} = {bound} B"
            # The old path (whole stage built, then sharded) must break the bound, or the bound proves nothing.
            assert r["eager_peak"] > bound, f"{where}: eager build peak {r['eager_peak']} B <= bound {bound} B"
