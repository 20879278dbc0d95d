"""Each pipeline schedule's predicted throughput on GPT-3 175B (tp 8, pp 16, dp 8), from step times measured on CPU.

    .venv/bin/python benchmarks/zero_bubble_at_scale.py                      # ~1 minute on one core
    .venv/bin/python benchmarks/zero_bubble_at_scale.py --hidden 1024 --seq 512

1. **Measured**: one micro batch of a GPT whose layers dominate (4 layers, hidden 512, seq 256, vocab 1024 by
   default; one process, one thread): its forward and plain backward (what 1F1B runs), and its forward with
   split ops, B step and W step (what the zero-bubble schedules run, ``tensor_parallel/weight_grad.py``). CPU
   seconds, the median of ``--repeats`` alternated rounds.
2. **Scaled**: a 175B stage's compute per micro batch (``planning/simulator.py``'s FLOPs per iteration for the
   flags of ``scripts/pretrain_gpt_175B.sh``, over 1024 devices at its default 312 TFLOP/s x 0.45, divided by
   the micro batches) is cut into F, B and W in the measured proportions. 1F1B's backward is the plain one;
   the split schedules' F, B and W are the split ones, so the split's measured overhead is carried to scale.
3. **Simulated**: every rank's order (``schedules.py``, ``zero_bubble.py``, ``v_schedules.py``) replayed by
   ``trace.simulate`` on 16 ranks (instant messages; the V schedules' and interleaving's chunks take their share
   of a stage's times). The iteration is the simulated makespan; tokens/s = global batch x 2048 / it.

Only the proportions of F, B and W matter for the gain over 1F1B (the scale cancels); the measured ones include
what a CPU adds (Python per op, the split's extra cost), which a GPU run has in other amounts. Run it with freed
memory kept, as a GPU's caching allocator keeps it (``split_backward_cost.py`` says why)::

    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=1073741824 \
        .venv/bin/python benchmarks/zero_bubble_at_scale.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from split_backward_cost import build  # noqa: E402

from megatron_like.config import parse_config  # noqa: E402
from megatron_like.pipeline_parallel.schedules import interleaved_steps, one_f_one_b_steps  # noqa: E402
from megatron_like.pipeline_parallel.trace import simulate  # noqa: E402
from megatron_like.pipeline_parallel.v_schedules import dualpipev_steps, zb_v_steps  # noqa: E402
from megatron_like.pipeline_parallel.zero_bubble import zb_h1_steps  # noqa: E402
from megatron_like.planning.simulator import plan_run  # noqa: E402
from megatron_like.tensor_parallel import weight_grad  # noqa: E402

# scripts/pretrain_gpt_175B.sh without its interleaving (each schedule below chooses its own chunks)
GPT3_175B = ["--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96", "--seq-length", "2048",
             "--max-position-embeddings", "2048", "--micro-batch-size", "1", "--tensor-model-parallel-size", "8",
             "--pipeline-model-parallel-size", "16", "--sequence-parallel", "--use-distributed-optimizer", "--bf16",
             "--recompute-granularity", "selective", "--vocab-size", "50257", "--mock-data"]
PP, WORLD, VOCAB = 16, 1024, 50257


def measure(hidden: int, seq: int, repeats: int) -> dict[str, float]:
    """CPU seconds of one micro batch: ``forward`` and ``backward`` (plain), ``split forward``, ``B``, ``W``."""
    model, ids = build(hidden, seq)
    positions = torch.arange(ids.shape[1])[None]
    params = list(model.parameters())
    times: dict[str, list[float]] = {"forward": [], "backward": [], "split forward": [], "B": [], "W": []}

    def timed(name: str, work: Callable[[], object]) -> object:
        start = time.process_time()
        result = work()
        times[name].append(time.process_time() - start)
        return result

    for _ in range(repeats + 1):  # the first round warms up and is dropped
        loss = timed("forward", lambda: model(ids, positions, labels=ids).float().mean())
        timed("backward", loss.backward)
        model.zero_grad(set_to_none=True)
        with weight_grad.split_backward():
            loss = timed("split forward", lambda: model(ids, positions, labels=ids).float().mean())
            with weight_grad.deferring_weight_grads(params) as work:
                timed("B", loss.backward)
        timed("W", work.run)
        model.zero_grad(set_to_none=True)
    return {name: statistics.median(values[1:]) for name, values in times.items()}


def stage_seconds_per_microbatch(global_batch: int) -> float:
    """A 175B pipeline rank's compute seconds per micro batch (planner FLOPs / devices / (peak x efficiency))."""
    config = parse_config(GPT3_175B + ["--global-batch-size", str(global_batch)], world_size=WORLD)
    plan = plan_run(config, config.padded_vocab_size(VOCAB))
    return plan.iteration_seconds * (1.0 - plan.bubble) / config.num_microbatches


def simulated_iteration(schedule: str, m: int, forward: float, backward: float, weight: float,
                        pp: int = PP) -> float:
    """Makespan of ``schedule``'s orders on ``pp`` ranks with a whole stage's step times (W only where split)."""
    if schedule == "1f1b":
        orders, chunks, v_shape = [one_f_one_b_steps(pp, r, m) for r in range(pp)], 1, False
    elif schedule == "interleaved (v = 3)":
        orders, chunks, v_shape = [interleaved_steps(pp, r, m, 3) for r in range(pp)], 3, False
    elif schedule == "zb-h1":
        orders, chunks, v_shape = [zb_h1_steps(pp, r, m) for r in range(pp)], 1, False
    else:
        order = zb_v_steps if schedule == "zb-v" else dualpipev_steps
        orders, chunks, v_shape = [order(pp, r, m) for r in range(pp)], 2, True
    events = simulate(orders, chunks, forward / chunks, backward / chunks, weight_time=weight / chunks,
                      v_shape=v_shape)
    return max(e.end for rank in events for e in rank) - min(e.start for rank in events for e in rank)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--global-batches", type=int, nargs="+", default=[1536, 256])
    parser.add_argument("--pp2-microbatches", type=int, default=8,
                        help="also simulate the measured model itself as one stage of a pp 2 pipeline with this many "
                        "micro batches (parallel_overhead.py's zero-bubble layout at --compute-dominates; 0: skip)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    t = measure(args.hidden, args.seq, args.repeats)
    plain, split = t["forward"] + t["backward"], t["split forward"] + t["B"] + t["W"]
    malloc = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
    print(f"# load average {os.getloadavg()[0]:.1f}, glibc malloc {malloc or 'defaults'}; measured (4 layers, "
          f"hidden {args.hidden}, seq {args.seq}, one "
          f"thread): forward {t['forward'] * 1e3:.1f} ms, backward {t['backward'] * 1e3:.1f} ms; split: forward "
          f"{t['split forward'] * 1e3:.1f}, B {t['B'] * 1e3:.1f}, W {t['W'] * 1e3:.1f} ms (split / plain "
          f"{split / plain:.3f})")
    if args.pp2_microbatches:
        # The most each schedule can gain in parallel_overhead.py's pp 2 run of this stage (8 layers split in two):
        # instant messages, and no slowdown from the two ranks sharing this machine's caches and memory bus.
        m = args.pp2_microbatches
        base = simulated_iteration("1f1b", m, t["forward"], t["backward"], 0.0, pp=2)
        gains = {name: base / simulated_iteration(name, m, t["split forward"], t["B"], t["W"], pp=2)
                 for name in ("zb-h1", "zb-v", "dualpipev")}
        print(f"# pp 2, {m} micro batches of this stage, simulated from these times: "
              + ", ".join(f"{name} {gain:.3f}x" for name, gain in gains.items()) + " our 1F1B (the most a run gains)")
    print("| global batch (micro batches) | schedule | F / B / W (ms, scaled) | bubble | tokens/s | vs 1f1b |")
    print("|---|---|---|---:|---:|---:|")
    for global_batch in args.global_batches:
        m = global_batch // (WORLD // (8 * PP))
        stage = stage_seconds_per_microbatch(global_batch)
        scale = stage / plain  # a CPU second of the measured model -> a 175B stage's second
        times = {"1f1b": (t["forward"], t["backward"], 0.0)}
        times["interleaved (v = 3)"] = times["1f1b"]
        for schedule in ("zb-h1", "zb-v", "dualpipev"):
            times[schedule] = (t["split forward"], t["B"], t["W"])
        baseline = None
        for schedule, (f, b, w) in times.items():
            iteration = simulated_iteration(schedule, m, f * scale, b * scale, w * scale)
            busy = m * (f + b + w) * scale
            tokens = global_batch * 2048 / iteration
            baseline = baseline or tokens
            steps = f"{f * scale * 1e3:.0f} / {b * scale * 1e3:.0f}" + (f" / {w * scale * 1e3:.0f}" if w else "")
            print(f"| {global_batch} ({m}) | {schedule} | {steps} | {1 - busy / iteration:.1%} | {tokens:,.0f} | "
                  f"{tokens / baseline:.3f}x |")


if __name__ == "__main__":
    main()
