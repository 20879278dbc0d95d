"""The Llama issue's "Done when" through the command line: a Llama-style tiny model (Megatron-LM's flags)
trained on 4 ranks (as torchrun starts them) at tp2 x pp2 with sequence parallelism logs the losses of one
process; its (torch_dist) checkpoint resumes on one process with the losses of the uninterrupted run (the QKV
groups and the SwiGLU (gate, up) pairs survive the layout change); and
``pretrain_gpt.py --help`` lists the architecture flags; a tokenizer.json trained here serves preprocessing,
training and generation of such a model.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch

from megatron_like.config import build_parser
from megatron_like.data.tokenizer import build_tokenizer
from megatron_like.inference import GenerationParams, generate, load_inference_model
from megatron_like.parallel_state import ParallelState
from tests.e2e.cli import ISSUE_FLAGS, in_process_losses, launch, logged_losses, run_data_tool, run_script

LLAMA_FLAGS = ISSUE_FLAGS + [
    "--position-embedding-type", "rope", "--rotary-base", "500000", "--normalization", "RMSNorm",
    "--norm-epsilon", "1e-5", "--swiglu", "--group-query-attention", "--num-query-groups", "2",
    "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--lr-decay-iters", "6",
]
TP2_PP2_SP = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--sequence-parallel"]


@functools.cache
def single_process_losses() -> dict[int, float]:
    return in_process_losses(LLAMA_FLAGS)


def assert_same_losses(losses: dict[int, float], iterations: range) -> None:
    """Within 1e-6 of the single process's (the log's 7 digits; fp32 layouts differ by ~1e-7): without the
    sequence-parallel gradient all-reduce of the norms the losses of iterations 2 and 3 move by 2e-6 and 8e-6."""
    expected = single_process_losses()
    assert sorted(losses) == list(iterations)
    for iteration in iterations:
        assert losses[iteration] == pytest.approx(expected[iteration], rel=1e-6), f"iteration {iteration}"


def test_llama_tp2_pp2_sp_logs_single_process_losses_and_continues_in_one_process(tmp_path):
    source = tmp_path / "tp2pp2"
    output = launch(4, LLAMA_FLAGS + TP2_PP2_SP + ["--train-iters", "3", "--save", str(source)])
    assert_same_losses(logged_losses(output), range(1, 4))

    # A torch_dist checkpoint (the default format) loads at another layout directly.
    resumed = launch(1, LLAMA_FLAGS + ["--load", str(source)])
    assert_same_losses(logged_losses(resumed), range(4, 7))
    losses = single_process_losses()
    assert losses[6] < losses[1] - 0.05


def test_help_lists_the_architecture_flags():
    text = build_parser().format_help()  # what pretrain_gpt.py --help prints (parse_config_or_exit's parser)
    for flag in ("--position-embedding-type", "--rotary-base", "--rotary-percent", "--normalization",
                 "--norm-epsilon", "--swiglu", "--group-query-attention", "--num-query-groups",
                 "--disable-bias-linear", "--add-qkv-bias", "--untie-embeddings-and-output-weights",
                 "--ffn-hidden-size", "--attention-backend", "--kv-channels", "--qk-layernorm"):
        assert flag in text, flag


def test_llama_with_a_trained_huggingface_tokenizer_preprocesses_trains_and_generates(tmp_path):
    """Megatron's --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR (a tokenizer.json trained here by
    data_tools/train_tokenizer.py, nothing downloaded) through preprocess, training and tools/generate.py."""
    corpus, tokenizer, data = tmp_path / "corpus.jsonl", tmp_path / "tokenizer", tmp_path / "docs"
    run_data_tool("make_demo_corpus.py", "--output", corpus, "--max-mb", "0.2")
    run_data_tool("train_tokenizer.py", "--input", corpus, "--output-dir", tokenizer, "--vocab-size", "512")
    hf_tokenizer = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tokenizer)]
    run_data_tool("preprocess.py", "--input", corpus, "--output-prefix", data, *hf_tokenizer, "--append-eod")
    flags = [flag for flag in LLAMA_FLAGS if flag != "--mock-data"]
    at = flags.index("--vocab-size")
    del flags[at:at + 2]
    output = launch(1, flags + ["--data-path", f"{data}_text_document", "--split", "98,2,0", "--eval-iters", "0",
                                  "--num-workers", "0", "--save", str(tmp_path / "ckpt")] + hf_tokenizer)
    losses = logged_losses(output)
    assert losses[6] < losses[1]
    generated = run_script("tools/generate.py", "--load", tmp_path / "ckpt", "--prompt", "def ", "--greedy",
                           "--max-new-tokens", "8", "--json").stdout
    record = json.loads(generated.splitlines()[-1])
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tokenizer))
    loaded = load_inference_model(str(tmp_path / "ckpt"), ParallelState.single_process(torch.device("cpu")))
    expected = generate(loaded.model, [tok.tokenize("def ")], GenerationParams(max_new_tokens=8), eod=tok.eod,
                        vocab_size=loaded.vocab_size)[0][0].token_ids
    assert record["prompt"] == "def " and record["token_ids"] == expected
    assert record["text"] == tok.detokenize([t for t in expected if t != tok.eod])
