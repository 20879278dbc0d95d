"""Does our code learn as well as a plain PyTorch model of the same size and recipe? Both sides, one table.

    .venv/bin/python benchmarks/learning_quality.py vit   # digits: ViT top-1, ours (1 process, tp2 x pp2) vs plain
    .venv/bin/python benchmarks/learning_quality.py gpt   # the demo's GPT: validation loss, ours vs plain

``vit``: scikit-learn's digits written by ``data_tools/make_digits_dataset.py`` (needs scikit-learn), the
README's ViT recipe (4 layers, hidden 128, 4 heads, patch 4, global batch 32, lr 1e-3, 20 warmup iterations,
300 iterations, dropout 0.1), trained by ``pretrain_vit.py`` in one process and at tp2 x pp2 (torchrun, 4 CPU
processes) and by ``benchmarks/plain_vit.py``; top-1 accuracy over the whole validation folder.

``gpt``: the corpus, tokenizer and flags of ``scripts/demo.sh`` (built under ``--work-dir`` if missing),
trained by ``pretrain_gpt.py`` in one process and at tp2 x pp2 and by ``benchmarks/plain_gpt.py`` on the same
samples, once from its own initial draw and once from our initial weights (``--same-init``: the two trainings
then agree step by step, so what is left between ours and the plain run is the initial draw); the validation
loss at every ``--eval-interval`` and the training loss curve.

Runs are sequential; each side prints its own log to ``--work-dir``. Several minutes per run on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
TORCHRUN = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4"]
TP2_PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]

VIT_RECIPE = ["--image-size", "32", "--patch-size", "4", "--num-layers", "4", "--hidden-size", "128",
              "--num-attention-heads", "4", "--micro-batch-size", "8", "--global-batch-size", "32",
              "--train-iters", "300", "--lr", "1e-3", "--lr-warmup-iters", "20", "--eval-interval", "100",
              "--eval-iters", "4", "--log-interval", "20", "--num-workers", "0", "--seed", "1234"]
DEMO_GPT = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
            "--max-position-embeddings", "128", "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
            "--micro-batch-size", "4", "--global-batch-size", "16", "--train-iters", "300", "--lr", "2e-3",
            "--min-lr", "2e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "20", "--weight-decay", "0.1",
            "--clip-grad", "1.0", "--seed", "1234", "--split", "98,2,0", "--num-workers", "0",
            "--log-interval", "20", "--eval-interval", "100", "--eval-iters", "5"]

TOP1 = re.compile(r"validation set: (\d+) images \| top-1 accuracy: ([0-9.]+)")
TRAIN_LOSS = re.compile(r"iteration\s+(\d+)(?:/\s*\d+)? \|(?:.*?\|)? (?:lm )?loss: ([0-9.E+-]+)")
VALID_LOSS = re.compile(r"validation loss at iteration (\d+) \| (?:.*?)lm loss value: ([0-9.E+-]+)")


def run(command: list[str], log: Path) -> str:
    """Run ``command`` from the repo root (one thread per process); keep its output in ``log``; return it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    print(f"$ {' '.join(command)}  > {log}", flush=True)
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}), see {log}:\n{proc.stderr[-2000:]}")
    return proc.stdout


def curve(pattern: re.Pattern, text: str) -> dict[int, float]:
    return {int(it): float(value) for it, value in pattern.findall(text)}


def vit(work: Path) -> None:
    data = work / "digits"
    if not (data / "val").is_dir():
        run([PY, "data_tools/make_digits_dataset.py", "--output-dir", str(data)], work / "make_digits.log")
    ours = [*VIT_RECIPE, "--data-path", str(data)]
    sides = {
        "ours, 1 process": run([PY, "pretrain_vit.py", *ours], work / "vit_ours_1proc.log"),
        "ours, tp2 x pp2": run([*TORCHRUN, "pretrain_vit.py", *ours, *TP2_PP2], work / "vit_ours_tp2pp2.log"),
        "plain PyTorch ViT": run([PY, "benchmarks/plain_vit.py", "--data-path", str(data)],
                                 work / "vit_plain.log"),
    }
    print("\n| run | top-1 on the val folder | training loss at iterations 100 / 200 / 300 |\n|---|---|---|")
    for name, out in sides.items():
        images, top1 = TOP1.search(out).groups()
        losses = curve(TRAIN_LOSS, out)
        trail = " / ".join(f"{losses[i]:.3f}" for i in (100, 200, 300) if i in losses)
        print(f"| {name} | {top1}% of {images} | {trail} |")


def demo_data(work: Path) -> tuple[list[str], list[str]]:
    """scripts/demo.sh's corpus, tokenizer and binarized set under ``work/demo``: (data flags, tokenizer flags)."""
    demo = work / "demo"
    prefix, tok = demo / "data" / "docs_text_document", demo / "tokenizer"
    if not Path(f"{prefix}.idx").exists():
        run([PY, "data_tools/make_demo_corpus.py", "--output", str(demo / "corpus.jsonl")], work / "corpus.log")
        run([PY, "data_tools/train_tokenizer.py", "--input", str(demo / "corpus.jsonl"), "--output-dir", str(tok),
             "--vocab-size", "4096"], work / "tokenizer.log")
        run([PY, "data_tools/preprocess.py", "--input", str(demo / "corpus.jsonl"), "--output-prefix",
             str(demo / "data" / "docs"), "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
             str(tok / "vocab.json"), "--merge-file", str(tok / "merges.txt"), "--append-eod", "--workers", "1"],
            work / "preprocess.log")
    return (["--data-path", str(prefix)],
            ["--vocab-file", str(tok / "vocab.json"), "--merge-file", str(tok / "merges.txt")])


def gpt(work: Path) -> None:
    data, tokenizer = demo_data(work)
    ours = [*DEMO_GPT, *data, "--tokenizer-type", "GPT2BPETokenizer", *tokenizer]
    sides = {
        "ours, 1 process": run([PY, "pretrain_gpt.py", *ours], work / "gpt_ours_1proc.log"),
        "ours, tp2 x pp2": run([*TORCHRUN, "pretrain_gpt.py", *ours, *TP2_PP2], work / "gpt_ours_tp2pp2.log"),
        "plain PyTorch GPT": run([PY, "benchmarks/plain_gpt.py", *data, *tokenizer], work / "gpt_plain.log"),
        "plain PyTorch GPT, our initial weights": run([PY, "benchmarks/plain_gpt.py", *data, *tokenizer,
                                                       "--same-init"], work / "gpt_plain_same_init.log"),
    }
    reference = curve(VALID_LOSS, sides["plain PyTorch GPT"])
    print("\n| run | validation loss at iterations 100 / 200 / 300 | vs plain at 300 | training loss every 20 "
          "iterations |\n|---|---|---|---|")
    for name, out in sides.items():
        valid, losses = curve(VALID_LOSS, out), curve(TRAIN_LOSS, out)
        last = max(valid)
        print(f"| {name} | {' / '.join(f'{v:.4f}' for v in valid.values())} | "
              f"{100 * (valid[last] / reference[last] - 1):+.2f}% | {' '.join(f'{v:.2f}' for v in losses.values())} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("workflow", choices=("vit", "gpt"))
    parser.add_argument("--work-dir", default="runs/learning_quality", help="data and logs of the runs")
    args = parser.parse_args(argv)
    work = (ROOT / args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    {"vit": vit, "gpt": gpt}[args.workflow](work)


if __name__ == "__main__":
    main()
