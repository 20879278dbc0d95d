"""Thread CPU time of one decoding step of the server's engine, by rows, against ``generate``'s one-row step.

    python benchmarks/serving_step.py                    # the model of benchmarks/serving.py, 1 thread

Runs in one process, no HTTP: ``BatchEngine`` (``megatron_like/inference/batching.py``) decoding 1 row, 16 rows of
one length, 16 rows of lengths 32..77 (a mask, longer contexts) and 16 rows of length 77 (the same columns read, no
mask), and ``generate`` decoding one prompt (what ``PUT /api`` runs); then rank 0's choice of 16 sampled rows
(``Scheduler._tokens``: the rows of one setting processed together, one uniform per row) against one
``torch.multinomial`` per row. Thread CPU time, the best of ``--trials`` groups of ``--steps`` steps: on a machine
shared with other work it moves far less than wall time.
A first table splits each engine step into its linears, SDPA, KV cache writes and reads, bias-GELU and ``begin``
(thread CPU timers wrapped around those functions while it runs).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_like.config import ModelConfig  # noqa: E402
from megatron_like.inference import GenerationParams, generate, process_logits  # noqa: E402
from megatron_like.inference.batching import Admission, BatchEngine  # noqa: E402
from megatron_like.inference.loading import InferenceModel  # noqa: E402
from megatron_like.inference.packed_linear import ensure_packed  # noqa: E402
from megatron_like.inference.scheduler import Job, Sampling, Scheduler  # noqa: E402
from megatron_like.model import GPTModel  # noqa: E402
from megatron_like.parallel_state import ParallelState  # noqa: E402


def best_cpu_ms(work, steps: int, trials: int) -> float:
    """Best mean thread CPU milliseconds of ``work()`` over ``trials`` groups of ``steps`` calls (after a warm-up)."""
    for _ in range(3):
        work()
    best = float("inf")
    for _ in range(trials):
        start = time.thread_time()
        for _ in range(steps):
            work()
        best = min(best, (time.thread_time() - start) / steps)
    return 1000 * best


@contextlib.contextmanager
def timed_parts(parts: dict[str, float]):
    """Within the block, add the thread CPU seconds of each step's parts (the functions below) to ``parts``."""
    from megatron_like.inference import packed_linear, slot_cache
    from megatron_like.model import transformer

    targets = {"linears": (packed_linear, "_packed_matmul"),
               "SDPA": (torch.nn.functional, "scaled_dot_product_attention"),
               "KV writes and reads": (slot_cache.SlotKVCache, "update_kv"),
               "bias-GELU": (transformer, "bias_gelu"),
               "begin": (slot_cache.SlotKVCache, "begin")}
    originals = {name: getattr(owner, attr) for name, (owner, attr) in targets.items()}

    def timed(name: str, function):
        def run(*args, **kwargs):
            start = time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                parts[name] = parts.get(name, 0.0) + time.thread_time() - start
        return run

    for name, (owner, attr) in targets.items():
        setattr(owner, attr, timed(name, originals[name]))
    try:
        yield
    finally:
        for name, (owner, attr) in targets.items():
            setattr(owner, attr, originals[name])


def step_parts_ms(work, steps: int, trials: int) -> dict[str, float]:
    """Per-step thread CPU milliseconds of ``work()`` ("whole") and of its parts (``timed_parts``), in its fastest
    of ``trials`` groups of ``steps`` calls."""
    work()
    fastest, fastest_parts = float("inf"), {}
    with timed_parts(parts := {}):
        for _ in range(trials):
            parts.clear()
            start = time.thread_time()
            for _ in range(steps):
                work()
            whole = time.thread_time() - start
            if whole < fastest:
                fastest, fastest_parts = whole, dict(parts)
    return {name: 1000 * seconds / steps for name, seconds in {"whole": fastest, **fastest_parts}.items()}


def engine_step(loaded: InferenceModel, lengths: list[int]):
    """A function running one decoding step of ``len(lengths)`` rows (prompts of those lengths, prefilled)."""
    engine = BatchEngine(loaded, 16)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, loaded.vocab_size, (n,), generator=generator).tolist() for n in lengths]
    out = engine.forward([Admission([slot], ids) for slot, ids in enumerate(prompts)])

    def step() -> None:
        nonlocal out
        engine.commit(out.rows, torch.stack([out.logits.argmax(-1), torch.zeros_like(out.logits[:, 0]).long()], 1))
        out = engine.forward([])

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = ModelConfig(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=256,
                         max_position_embeddings=256, hidden_dropout=0.0, attention_dropout=0.0, vocab_size=1024)
    model = GPTModel(config, ParallelState.single_process(torch.device("cpu")), vocab_size=1024, seed=1).eval()
    loaded = InferenceModel([model], type("Config", (), {"model": config})(), None, 1024, None)

    # 16 rows of length 77 read as many cached columns as the staggered rows (78) without a mask: the difference
    # between those two is the mask's, the rest of the staggered rows' extra cost is their longer context.
    lengths = {"engine, 1 row": [32], "engine, 16 rows of one length": [32] * 16,
               "engine, 16 rows of lengths 32..77": [32 + 3 * i for i in range(16)],
               "engine, 16 rows of length 77": [77] * 16}
    times = {name: best_cpu_ms(engine_step(loaded, rows), args.steps, args.trials) for name, rows in lengths.items()}
    new_tokens = args.steps * args.trials  # generate's loop: time it whole, per token
    ensure_packed(loaded.model, 1)
    start = time.thread_time()
    generate(loaded.model, [list(range(32))], GenerationParams(max_new_tokens=new_tokens), vocab_size=1024)
    times["generate, 1 row (PUT /api)"] = 1000 * (time.thread_time() - start) / new_tokens

    logits = torch.randn(16, 1024, generator=torch.Generator().manual_seed(1))
    scheduler = Scheduler(loaded, BatchEngine(loaded, 1), str, 1)
    jobs = [Job([1], Sampling(temperature=0.8, seed=i)) for i in range(16)]
    pairs = [(job, job.choices[0]) for job in jobs]
    generators = [torch.Generator().manual_seed(i) for i in range(16)]

    def per_row_multinomial() -> list[int]:
        return [int(torch.multinomial(process_logits(logits[i:i + 1], 0.8).softmax(-1)[0], 1, generator=g))
                for i, g in enumerate(generators)]

    times["choose 16 sampled rows (Scheduler._tokens)"] = best_cpu_ms(lambda: scheduler._tokens(logits, pairs),
                                                                      args.steps, args.trials)
    times["choose 16 sampled rows, torch.multinomial per row"] = best_cpu_ms(per_row_multinomial, args.steps,
                                                                              args.trials)
    print("Parts of each engine step (thread CPU ms; the rest is the model's per-layer Python):\n")
    names = ["whole", "linears", "SDPA", "KV writes and reads", "bias-GELU", "begin"]
    print("| step | " + " | ".join(names) + " |\n|---|" + "---:|" * len(names))
    for name, rows in lengths.items():
        parts = step_parts_ms(engine_step(loaded, rows), args.steps, args.trials)
        print(f"| {name} | " + " | ".join(f"{parts.get(part, 0.0):.2f}" for part in names) + " |")
    print()
    print("| what | thread CPU (ms) |\n|---|---:|")
    for name, ms in times.items():
        print(f"| {name} | {ms:.3f} |")
    one, alone = times["engine, 1 row"], times["generate, 1 row (PUT /api)"]
    for name, rows in lengths.items():
        print(f"{name}: {times[name] / one:.2f}x the 1-row step; a token costs generate's 1-row step / "
              f"{alone * len(rows) / times[name]:.2f}")


if __name__ == "__main__":
    main()
