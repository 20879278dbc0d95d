"""The golden runs: two fixed-seed single-process trainings whose losses are stored as JSON.

* ``mock``: the 4-layer model of the equivalence tests (``BASE_FLAGS``) on mock data, with dropout,
  warmup and cosine decay, for 8 iterations.
* ``text``: a 2-layer model on real English: ``tests/data/docstrings.jsonl`` (53 docstrings of CPython
  3.11's standard library, PSF license, written once by ``data_tools/make_demo_corpus.py --max-mb 0.03``
  and shipped so the corpus does not change with the Python version), binarized with GPT-2's BPE by
  ``data_tools/preprocess.py``, trained with a train/validation split for 8 iterations.

Each run returns its training losses and (``text``) validation losses, both per iteration.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

GOLDEN_DIR = Path(__file__).resolve().parent
ROOT = GOLDEN_DIR.parents[1]
CORPUS = ROOT / "tests" / "data" / "docstrings.jsonl"
SCHEDULE = ["--train-iters", "8", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--min-lr", "1e-4",
            "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
TEXT_FLAGS = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
    "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "2e-3",
    "--log-interval", "1", "--seed", "1234", "--num-workers", "0", "--split", "90,10,0", "--eval-interval", "4",
    "--eval-iters", "1", "--tokenizer-type", "GPT2BPETokenizer", "--eod-mask-loss", *SCHEDULE,
]


def _pretrain(flags: list[str]) -> dict:
    import pretrain_gpt
    from megatron_like.config import parse_config
    from megatron_like.parallel_state import ParallelState
    from megatron_like.training import pretrain

    config = parse_config(flags, world_size=1)
    ps = ParallelState.single_process(torch.device("cpu"))
    vocab = config.padded_vocab_size(config.model.vocab_size or 50257)
    provider = functools.partial(pretrain_gpt.model_provider, padded_vocab_size=vocab)
    result = pretrain(config, provider, pretrain_gpt.forward_step, pretrain_gpt.datasets_provider, ps=ps,
                      padded_vocab_size=vocab)
    return {"losses": result.losses, "validation_losses": result.validation_losses}


def mock_flags() -> list[str]:
    from tests.distributed.gpt_runs import BASE_FLAGS

    return BASE_FLAGS + SCHEDULE


def run_mock() -> dict:
    return _pretrain(mock_flags())


def run_text() -> dict:
    """Binarize the shipped corpus into a temporary directory and train on it."""
    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "docs")
        subprocess.run([sys.executable, str(ROOT / "data_tools" / "preprocess.py"), "--input", str(CORPUS),
                        "--output-prefix", prefix, "--tokenizer-type", "GPT2BPETokenizer", "--append-eod",
                        "--workers", "1"], check=True, capture_output=True, timeout=300)
        return _pretrain(TEXT_FLAGS + ["--data-path", f"{prefix}_text_document"])


RUNS = {"mock": run_mock, "text": run_text}


def golden_path(name: str) -> Path:
    return GOLDEN_DIR / f"{name}.json"


def load_golden(name: str) -> dict:
    with open(golden_path(name)) as f:
        return json.load(f)
