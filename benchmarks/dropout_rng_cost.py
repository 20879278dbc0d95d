"""What ``--dropout-rng layout-independent`` costs against Megatron's streams: CPU time of a training step's forward and
backward through transformer layers with dropout on, one process, each mode's step timed in turns.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/dropout_rng_cost.py [--repeats 20]

Two shapes: the ViT recipe's layers (65 tokens, batch 8, h 128, 4 heads) and a GPT-like one (512 tokens, batch 2,
h 256, 8 heads). Prints the median thread CPU time per step of each mode and their ratio. What it cannot show: a
GPU, where the per-head attention is ``heads / tp`` kernel launches of one head each instead of one launch (see
model/dropout.py), so the ratio there depends on the launch overhead and the occupancy of one-head kernels.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_like.config import ModelConfig  # noqa: E402
from megatron_like.model.transformer import TransformerLayer, forward_layers  # noqa: E402
from megatron_like.parallel_state import ParallelState  # noqa: E402
from megatron_like.tensor_parallel import seed_everything  # noqa: E402

SHAPES = {"vit": dict(seq=65, batch=8, hidden=128, heads=4), "gpt": dict(seq=512, batch=2, hidden=256, heads=8)}
MODES = ("megatron", "layout-independent")


def step_time(layers: torch.nn.ModuleList, config: ModelConfig, x: torch.Tensor) -> float:
    """Thread CPU seconds of one forward and backward of ``layers`` on ``x [s, b, h]``."""
    begin = time.thread_time()
    forward_layers(layers, x, config).sum().backward()
    return time.thread_time() - begin


def measure(shape: dict, repeats: int) -> dict[str, float]:
    """Median step seconds per mode, the modes taking turns (load on the machine hits both alike)."""
    ps = ParallelState.single_process(torch.device("cpu"))
    built = {}
    for mode in MODES:
        config = ModelConfig(num_layers=2, hidden_size=shape["hidden"], num_attention_heads=shape["heads"],
                             seq_length=shape["seq"], hidden_dropout=0.1, attention_dropout=0.1, dropout_rng=mode)
        layers = torch.nn.ModuleList(TransformerLayer(config, ps, i, 0, False, torch.float32, causal=False)
                                     for i in range(2))
        built[mode] = (layers, config)
    seed_everything(0, 0, 0)
    x = torch.randn(shape["seq"], shape["batch"], shape["hidden"], requires_grad=True)
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(repeats + 1):  # the first round warms up
        for mode in MODES:
            times[mode].append(step_time(*built[mode], x))
    return {mode: statistics.median(values[1:]) for mode, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| shape | megatron (ms) | layout-independent (ms) | ratio |\n|---|---|---|---|")
    for name, shape in SHAPES.items():
        median = measure(shape, args.repeats)
        print(f"| {name} {shape} | {1e3 * median['megatron']:.2f} | {1e3 * median['layout-independent']:.2f} | "
              f"{median['layout-independent'] / median['megatron']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
