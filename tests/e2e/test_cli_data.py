"""Real data end to end: corpus -> preprocess (GPT-2 BPE) -> pretrain_gpt.py on 2 ranks (as torchrun starts them)
with validation."""

from __future__ import annotations

import math
import re

from tests.e2e.cli import launch, logged_losses, run_script

VALIDATION = re.compile(
    r"validation loss at iteration (\d+) \| lm loss value: ([0-9.E+-]+) \| lm loss PPL: ([0-9.E+-]+)"
)


def test_preprocessed_corpus_trains_with_tensor_parallel_and_validates(tmp_path):
    corpus, prefix = tmp_path / "corpus.jsonl", tmp_path / "data" / "docs"
    run_script("data_tools/make_demo_corpus.py", "--output", corpus, "--max-mb", "0.3")
    run_script("data_tools/preprocess.py", "--input", corpus, "--output-prefix", prefix,
             "--tokenizer-type", "GPT2BPETokenizer", "--append-eod", "--workers", "1")
    output = launch(2, [
        "--tensor-model-parallel-size", "2", "--num-layers", "2", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--train-iters", "4", "--lr", "1e-3", "--log-interval", "1", "--eval-interval", "2", "--eval-iters", "1",
        "--data-path", f"{prefix}_text_document", "--split", "98,2,0", "--tokenizer-type", "GPT2BPETokenizer",
        "--num-workers", "0", "--eod-mask-loss",
    ])
    losses = logged_losses(output)
    assert sorted(losses) == [1, 2, 3, 4] and all(math.isfinite(v) for v in losses.values())
    # GPT-2's vocabulary (50257, padded to 50432 for tp=2): the untrained loss is about ln(50257) = 10.8.
    assert 9.0 < losses[1] < 12.0
    validations = VALIDATION.findall(output)
    assert [int(it) for it, _, _ in validations] == [2, 4]
    for _, loss, ppl in validations:
        assert math.isclose(float(ppl), math.exp(float(loss)), rel_tol=1e-4)
    assert "number of parameters on (tensor, pipeline) model parallel rank (1, 0)" in output
    # rank 0 says how tp padded the vocabulary (its rows take part in the softmax: tp 1 pads to 50304)
    assert output.count(" > padded vocab (size: 50257) with 175 dummy tokens (new size: 50432)\n") == 1
