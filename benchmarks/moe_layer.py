"""One MoE layer's forward + backward at expert parallelism 2 against the same layer at ep 1 and a dense MLP of the
same active FLOPs, on 2 gloo processes (one thread each).

    .venv/bin/python benchmarks/moe_layer.py                 # hidden 256, 8 experts top-2, 1024 tokens per rank
    .venv/bin/python benchmarks/moe_layer.py --steps 9 --tokens 2048

Sides (each rank runs its own ``[s, b, h]`` micro batch; SwiGLU experts, fp32):

- ``ep2 alltoall`` / ``ep2 allgather``: ``E / 2`` experts per rank, tokens exchanged by the dispatcher.
- ``ep1``: the same router and all E experts on every rank, no exchange (the layer's compute alone).
- ``dense``: one SwiGLU MLP of hidden ``k f`` (the FLOPs of a token's k experts; no router, no permutation).

Timing: per step, rank 0's wall time between barriers around a forward + backward, and each rank's CPU seconds
(the busier rank's median: far less disturbed by other jobs on the machine); the sides alternate step by
step so a slow period of the machine hits each; medians. ``tokens/s`` counts both ranks' tokens. Traffic: the
bytes rank 0 sends during one ep2 step (``collectives.count_traffic``) against
``planning.simulator.expert_parallel_bytes`` (balanced routing). Timings on a shared machine are noisy: compare
ratios from one run.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SIDES = ["ep2 alltoall", "ep2 allgather", "ep1", "dense"]


def flags(hidden: int, experts: int, topk: int, ffn: int, tokens: int, dispatcher: str) -> list[str]:
    """pretrain_gpt.py flags of a one-layer model whose MoE layer the benchmark runs (ep 2 in dp 2)."""
    return ["--num-layers", "1", "--hidden-size", str(hidden), "--num-attention-heads", "4", "--seq-length",
            str(tokens), "--micro-batch-size", "1", "--global-batch-size", "2", "--mock-data", "--vocab-size", "64",
            "--swiglu", "--disable-bias-linear", "--num-experts", str(experts), "--moe-router-topk", str(topk),
            "--moe-ffn-hidden-size", str(ffn), "--moe-router-load-balancing-type", "none",
            "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", dispatcher]


def run_sides(rank: int, world_size: int, hidden: int, experts: int, topk: int, ffn: int, tokens: int,
              steps: int) -> dict:
    from megatron_like import collectives
    from megatron_like.config import parse_config
    from megatron_like.model.moe import MoELayer
    from megatron_like.model.transformer import MLP
    from megatron_like.parallel_state import ParallelState

    configs = {d: parse_config(flags(hidden, experts, topk, ffn, tokens, d), world_size)
               for d in ("alltoall", "allgather")}
    ps = ParallelState.initialize(configs["alltoall"].parallel, world_size)
    single = ParallelState.single_process(torch.device("cpu"))
    model = configs["alltoall"].model
    layers = {
        "ep2 alltoall": MoELayer(model, ps, 0, 1, False, torch.float32),
        "ep2 allgather": MoELayer(configs["allgather"].model, ps, 0, 1, False, torch.float32),
        "ep1": MoELayer(model, single, 0, 1, False, torch.float32),
        "dense": MLP(dataclasses.replace(model, num_experts=None, moe_ffn_hidden_size=None, ffn_hidden_size=topk * ffn),
                     single, 0, 1, False, torch.float32),
    }
    x = torch.randn(tokens, 1, hidden, generator=torch.Generator().manual_seed(rank))

    def step(name: str) -> tuple[float, float]:
        """(wall, CPU) seconds of one forward + backward; CPU counts the process (gloo's threads included)."""
        inp = x.clone().requires_grad_(True)
        collectives.barrier(ps.dp_group)
        start, start_cpu = time.perf_counter(), time.process_time()
        layers[name](inp).square().mean().backward()
        cpu = time.process_time() - start_cpu  # before the barrier: a rank waiting for the other spins gloo
        collectives.barrier(ps.dp_group)
        return time.perf_counter() - start, cpu

    sent = {}
    for name in SIDES:  # warm-up, and the traffic of one step
        with collectives.count_traffic() as traffic:
            step(name)
        sent[name] = traffic.bytes_sent
    times: dict[str, list[float]] = {name: [] for name in SIDES}
    cpu: dict[str, list[float]] = {name: [] for name in SIDES}
    for i in range(steps):
        order = SIDES if i % 2 == 0 else SIDES[::-1]
        for name in order:
            wall, cpu_seconds = step(name)
            times[name].append(wall)
            cpu[name].append(cpu_seconds)
    return {"times": times, "cpu": cpu, "sent": sent}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--ffn", type=int, default=512, help="each expert's hidden size")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per rank per step")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per side")
    args = parser.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"
    from megatron_like.config import parse_config
    from megatron_like.planning.simulator import expert_parallel_bytes
    from tests.distributed.harness import run_distributed

    sizes = (args.hidden, args.experts, args.topk, args.ffn, args.tokens)
    results = run_distributed(run_sides, 2, *sizes, args.steps, timeout=3600)
    rank0 = results[0]
    print(f"# hidden {args.hidden}, {args.experts} experts top-{args.topk} of hidden {args.ffn} (SwiGLU), "
          f"{args.tokens} tokens per rank, fp32, 2 processes x 1 thread, {args.steps} timed steps per side, "
          f"load average {os.getloadavg()[0]:.1f}")
    print("| side | s/step (median) | tokens/s | vs ep1 (wall) | CPU s/step/rank | vs ep1 (CPU) | sent KiB/rank "
          "| planned KiB/rank |")
    print("|---|---|---|---|---|---|---|---|")
    ep1 = statistics.median(rank0["times"]["ep1"])

    def cpu_per_step(name: str) -> float:  # the busier rank's median
        return max(statistics.median(r["cpu"][name]) for r in results)

    for name in SIDES:
        median = statistics.median(rank0["times"][name])
        planned = "-"
        if name.startswith("ep2"):
            config = parse_config(flags(*sizes, name.split()[1]), world_size=2)
            planned = f"{expert_parallel_bytes(config, 0) / 1024:.1f}"
        print(f"| {name} | {median:.4f} | {2 * args.tokens / median:,.0f} | {ep1 / median:.2f} | "
              f"{cpu_per_step(name):.4f} | {cpu_per_step('ep1') / cpu_per_step(name):.2f} | "
              f"{rank0['sent'][name] / 1024:.1f} | {planned} |")


if __name__ == "__main__":
    main()
