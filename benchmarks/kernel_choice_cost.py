"""What choosing a fused kernel costs on CPU: per call, per small op, and per demo-sized training step, for
two source trees (say, before and after a change) measured in alternating fresh processes.

For each trial and tree (the order flips every trial), a fresh Python with that tree first on ``sys.path``
measures, all on one thread:

- ``pick_kernel``: ns per ``_common.pick_kernel("rms_norm", x, w)`` (x ``[64, 128]`` float32), the choice alone;
- ``rms_norm op``: ns per ``fused_rms_norm`` forward of the same rows (no autograd), the choice plus the kernel;
- ``gpt step`` / ``llama step``: CPU ms per forward + backward of scripts/demo.sh's model (4 layers, hidden 128,
  4 heads, seq 128, vocab 512, micro batch 4; the Llama-style one with RoPE, RMSNorm and SwiGLU), which run
  the fused kernels of their layers (bias-GELU, cross entropy; RMSNorm, SwiGLU, rotary).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/kernel_choice_cost.py --trees /tmp/before . [--trials 5]

A tree is a directory holding ``megatron_like/`` with its compiled ``_csrc`` modules (e.g. ``git archive`` of an
older commit, with ``megatron_like/_csrc/*.so`` copied in).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import timeit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = dict(num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=128, max_position_embeddings=128,
            hidden_dropout=0.0, attention_dropout=0.0)
LLAMA = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, disable_bias_linear=True)
MICRO_BATCH, VOCAB = 4, 512


def best_ns(statement: callable, number: int, repeat: int = 5) -> float:
    """The fastest of ``repeat`` timings, ns per call."""
    return min(timeit.repeat(statement, number=number, repeat=repeat)) / number * 1e9


def step_cpu_ms(model_kwargs: dict, steps: int) -> float:
    """Median CPU ms of forward + backward of the demo model (after one warm-up)."""
    import torch

    from megatron_like.config import ModelConfig
    from megatron_like.model import GPTModel
    from megatron_like.parallel_state import ParallelState

    torch.manual_seed(0)
    model = GPTModel(ModelConfig(**DEMO, **model_kwargs), ParallelState.single_process(torch.device("cpu")),
                     vocab_size=VOCAB, seed=1234)
    tokens = torch.randint(VOCAB, (MICRO_BATCH, DEMO["seq_length"] + 1))
    positions = torch.arange(DEMO["seq_length"]).unsqueeze(0).expand(MICRO_BATCH, -1)
    times = []
    for _ in range(steps + 1):
        begin = time.process_time()
        model(tokens[:, :-1], positions, labels=tokens[:, 1:]).mean().backward()
        times.append((time.process_time() - begin) * 1e3)
    return statistics.median(times[1:])


def measure(steps: int) -> dict[str, float]:
    """This process's figures (its megatron_like is whichever tree is first on sys.path)."""
    import torch

    from megatron_like.kernels import _common, fused_rms_norm

    torch.set_num_threads(1)
    x, w = torch.randn(64, 128), torch.randn(128)
    assert _common.pick_kernel("rms_norm", x, w) is not None, "the compiled kernels are not built in this tree"
    with torch.no_grad():
        op = best_ns(lambda: fused_rms_norm(x, w, 1e-5), 20_000)
    return {
        "pick_kernel ns": best_ns(lambda: _common.pick_kernel("rms_norm", x, w), 100_000),
        "rms_norm op ns": op,
        "gpt step ms": step_cpu_ms({}, steps),
        "llama step ms": step_cpu_ms(LLAMA, steps),
    }


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        print("RESULT " + json.dumps(measure(int(argv[1]))), flush=True)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trees", nargs=2, required=True, metavar=("BEFORE", "AFTER"))
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per model per trial")
    args = parser.parse_args(argv)
    trees = [os.path.abspath(t) for t in args.trees]
    for tree in trees:
        if not os.path.isdir(os.path.join(tree, "megatron_like")):
            parser.error(f"--trees {tree}: no megatron_like/ there")
    print(f"# {args.trials} trials, load average {os.getloadavg()[0]:.1f}")
    results: dict[str, list[dict]] = {tree: [] for tree in trees}
    for trial in range(args.trials):
        for tree in (trees if trial % 2 == 0 else trees[::-1]):
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=tree)
            done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", str(args.steps)],
                                  cwd=tree, env=env, capture_output=True, text=True, timeout=1800)
            if done.returncode != 0:
                sys.exit(f"{tree}: {done.stderr[-3000:]}")
            results[tree].append(json.loads(done.stdout.split("RESULT ", 1)[1]))
    before, after = (results[tree] for tree in trees)
    print("| figure | before (median) | after (median) | after / before |")
    print("|---|---:|---:|---:|")
    for key in before[0]:
        b, a = statistics.median(r[key] for r in before), statistics.median(r[key] for r in after)
        print(f"| {key} | {b:.1f} | {a:.1f} | {a / b:.3f} |")
    print(f"# load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
