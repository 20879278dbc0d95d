"""The Llama issue's "Done when" through the command line: a Llama-style tiny model (Megatron-LM's flags)
trained by torchrun at tp2 x pp2 with sequence parallelism logs the losses of one process; its checkpoint
resharded to tp1 x pp1 with tools/checkpoint_reshard.py resumes on one process with the losses of the
uninterrupted run (the QKV groups and the SwiGLU (gate, up) pairs survive the tp merge); and
``pretrain_gpt.py --help`` lists the architecture flags.
"""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest

from megatron_like.config import build_parser
from tests.e2e.cli import ISSUE_FLAGS, ROOT, logged_losses, torchrun

LLAMA_FLAGS = ISSUE_FLAGS + [
    "--position-embedding-type", "rope", "--rotary-base", "500000", "--normalization", "RMSNorm",
    "--norm-epsilon", "1e-5", "--swiglu", "--group-query-attention", "--num-query-groups", "2",
    "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--lr-decay-iters", "6",
]
TP2_PP2_SP = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--sequence-parallel"]


@functools.cache
def single_process_losses() -> dict[int, float]:
    return logged_losses(torchrun(1, LLAMA_FLAGS))


def assert_same_losses(losses: dict[int, float], iterations: range) -> None:
    expected = single_process_losses()
    assert sorted(losses) == list(iterations)
    for iteration in iterations:
        assert losses[iteration] == pytest.approx(expected[iteration], rel=1e-4), f"iteration {iteration}"


def test_llama_tp2_pp2_sp_logs_single_process_losses_and_reshards_to_one_process(tmp_path):
    source, target = tmp_path / "tp2pp2", tmp_path / "tp1pp1"
    output = torchrun(4, LLAMA_FLAGS + TP2_PP2_SP + ["--train-iters", "3", "--save", str(source)])
    assert_same_losses(logged_losses(output), range(1, 4))

    subprocess.run([sys.executable, "tools/checkpoint_reshard.py", "--load", str(source), "--save", str(target),
                    "--target-tensor-model-parallel-size", "1", "--target-pipeline-model-parallel-size", "1"],
                   cwd=ROOT, check=True, capture_output=True)
    resumed = torchrun(1, LLAMA_FLAGS + ["--load", str(target)])
    assert_same_losses(logged_losses(resumed), range(4, 7))
    losses = single_process_losses()
    assert losses[6] < losses[1] - 0.05


def test_help_lists_the_architecture_flags():
    text = build_parser().format_help()  # what pretrain_gpt.py --help prints (parse_config_or_exit's parser)
    for flag in ("--position-embedding-type", "--rotary-base", "--rotary-percent", "--normalization",
                 "--norm-epsilon", "--swiglu", "--group-query-attention", "--num-query-groups",
                 "--disable-bias-linear", "--add-qkv-bias", "--untie-embeddings-and-output-weights",
                 "--ffn-hidden-size", "--attention-backend"):
        assert flag in text, flag
