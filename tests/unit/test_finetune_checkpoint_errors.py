"""A fine-tune whose --pretrained-checkpoint cannot be used stops with one line, before any work.

``finetune_gpt_classification.py`` used to read the checkpoint only when each stage built its chunk: a missing
directory raised ``CheckpointLoadError`` through ``exit_on_checkpoint_error`` (which caught ``CheckpointError``
only), a traceback; a checkpoint of another shape a ``ValueError`` traceback after the data was tokenized.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import finetune_gpt_classification as task
from megatron_like.config import parse_config
from megatron_like.model import GPTModel
from megatron_like.model.state import CheckpointLoadError
from megatron_like.parallel_state import ParallelState
from megatron_like.training.checkpoint_validation import exit_on_checkpoint_error
from megatron_like.training.checkpointing import save_checkpoint

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--make-vocab-size-divisible-by", "8"]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """Generated MRPC-like pairs, their word tokenizer, and a GPT checkpoint of ``MODEL``'s shape (not trained)."""
    from data_tools.make_mrpc_like import generate, write, write_word_tokenizer

    root = tmp_path_factory.mktemp("finetune_errors")
    pairs = generate(16, 1)
    paths = {"train": str(root / "train.tsv"), "tokenizer": str(root / "tok.json"), "checkpoint": str(root / "gpt")}
    write(paths["train"], pairs)
    vocab = write_word_tokenizer(paths["tokenizer"], pairs)
    config = parse_config(MODEL + ["--mock-data", "--vocab-size", str(vocab), "--save", paths["checkpoint"],
                                   "--ckpt-format", "torch"],
                          world_size=1)
    ps = ParallelState.single_process(torch.device("cpu"))
    model = [GPTModel(config.model, ps, vocab_size=config.padded_vocab_size(vocab), seed=1)]
    save_checkpoint(paths["checkpoint"], 2, config, ps, model, torch.optim.AdamW(model[0].parameters()), None, 8)
    return paths


def finetune_argv(files: dict[str, str], checkpoint: str, *extra: str) -> list[str]:
    return [*MODEL, "--pretrained-checkpoint", checkpoint, "--train-data", files["train"], "--tokenizer-type",
            "HuggingFaceTokenizer", "--tokenizer-model", files["tokenizer"], "--micro-batch-size", "8",
            "--global-batch-size", "8", "--train-iters", "2", "--num-workers", "0", *extra]


def refusal(argv: list[str], capsys) -> str:
    """Run the fine-tune's main; it must exit with status 2 printing one ``error:`` line and nothing else."""
    with pytest.raises(SystemExit) as exited:
        task.main(argv)
    assert exited.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "", captured.out  # nothing was loaded, tokenized or trained
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    return lines[0]


def test_a_matching_checkpoint_passes_the_check(files):
    config, _ = task.build_config(finetune_argv(files, files["checkpoint"]))
    assert config.model.hidden_size == 32


def test_a_missing_directory_is_one_line(files, tmp_path, capsys):
    line = refusal(finetune_argv(files, str(tmp_path / "nowhere")), capsys)
    assert "is missing; pass the directory pretrain_gpt.py --save wrote" in line


def test_a_directory_without_tracker_is_one_line(files, tmp_path, capsys):
    line = refusal(finetune_argv(files, str(tmp_path)), capsys)
    assert "holds no latest_checkpointed_iteration.txt" in line


def test_a_checkpoint_without_its_shard_is_one_line(files, tmp_path, capsys):
    broken = str(tmp_path / "gpt")
    shutil.copytree(files["checkpoint"], broken)
    os.remove(os.path.join(broken, "iter_0000002", "mp_rank_00_000", "model_optim_rng.pt"))
    line = refusal(finetune_argv(files, broken), capsys)
    assert "cannot be read" in line and "model_optim_rng.pt is missing" in line


def test_a_checkpoint_of_another_shape_is_one_line(files, capsys):
    argv = finetune_argv(files, files["checkpoint"])
    argv[argv.index("--hidden-size") + 1] = "64"
    line = refusal(argv, capsys)
    assert "has hidden_size 32, this model 64; pass the checkpoint's model flags" in line


def test_exit_on_checkpoint_error_takes_load_errors(capsys):
    """A CheckpointLoadError raised while the stages load their shards (every rank reads the same files)."""
    with pytest.raises(SystemExit) as exited, exit_on_checkpoint_error():
        raise CheckpointLoadError("checkpoint file x/mp_rank_01_000/model_optim_rng.pt is missing")
    assert exited.value.code == 1
    assert capsys.readouterr().err == "error: checkpoint file x/mp_rank_01_000/model_optim_rng.pt is missing\n"
