"""The dataclass config is the single source of the CLI flags, and bad values fail with one line."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_like.config import Config, ConfigError, build_parser, field_docstrings, parse_config

ROOT = Path(__file__).resolve().parents[2]
MOCK = ["--mock-data", "--vocab-size", "512"]


def test_every_field_has_a_flag_and_a_docstring():
    parser = build_parser()
    flags = {opt for action in parser._actions for opt in action.option_strings}
    for group_cls in (type(g) for g in Config().groups().values()):
        docs = field_docstrings(group_cls)
        for f in dataclasses.fields(group_cls):
            assert docs.get(f.name), f"{group_cls.__name__}.{f.name} has no docstring"
            positive, negative = "--" + f.name.replace("_", "-"), "--no-" + f.name.replace("_", "-")
            assert positive in flags or negative in flags, f"no flag for {f.name}"


def test_megatron_flag_names_parse():
    config = parse_config(
        ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "8", "--seq-length", "64",
         "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--micro-batch-size", "1",
         "--global-batch-size", "8", "--lr", "3e-4", "--lr-decay-style", "cosine", "--no-load-optim",
         "--untie-embeddings-and-output-weights", "--data-path", "0.3", "a", "0.7", "b", "--split", "98,2,0"],
        world_size=8,
    )
    assert config.model.num_layers == 4 and config.parallel.tensor_model_parallel_size == 2
    assert config.data_parallel_size == 2 and config.num_microbatches == 4
    assert config.optimizer.lr_decay_style == "cosine" and config.checkpoint.load_optim is False
    assert config.model.untie_embeddings_and_output_weights is True
    assert config.data.data_path == ["0.3", "a", "0.7", "b"]
    assert config.padded_vocab_size(50257) == 50432  # Megatron pads to 128 * tp


def test_round_trip_through_dict():
    config = parse_config(MOCK + ["--sequence-parallel", "--tensor-model-parallel-size", "2"], world_size=2)
    assert Config.from_dict(config.to_dict()) == config


@pytest.mark.parametrize(
    "flags,world_size,message",
    [
        (["--tensor-model-parallel-size", "3"], 3, "--num-attention-heads 4 is not divisible by "
                                                   "--tensor-model-parallel-size 3"),
        (["--hidden-size", "66"], 1, "--hidden-size 66 is not divisible by --num-attention-heads 4"),
        (["--tensor-model-parallel-size", "2"], 3, "world size 3 is not divisible"),
        (["--global-batch-size", "6", "--micro-batch-size", "4"], 1, "--global-batch-size 6 is not divisible"),
        (["--num-layers", "3", "--pipeline-model-parallel-size", "2"], 2, "--num-layers 3 is not divisible"),
        (["--seq-length", "33", "--max-position-embeddings", "40", "--tensor-model-parallel-size", "2",
          "--sequence-parallel"], 2, "--seq-length 33 is not divisible"),
        (["--fp16", "--bf16"], 1, "--fp16 and --bf16 are exclusive"),
        (["--max-position-embeddings", "8"], 1, "--max-position-embeddings 8 is smaller than --seq-length 32"),
        (["--hidden-dropout", "1.5"], 1, "--hidden-dropout 1.5 must be in [0, 1)"),
        (["--num-layers-per-virtual-pipeline-stage", "1"], 1, "needs --pipeline-model-parallel-size > 1"),
        (["--recompute-granularity", "full"], 1, "--recompute-granularity full needs --recompute-method"),
        (["--overlap-param-gather"], 2, "--overlap-param-gather needs --zero-stage 1, 2 or 3"),
    ],
)
def test_invalid_values_fail_with_one_line(flags, world_size, message):
    with pytest.raises(ConfigError) as error:
        parse_config(MOCK + flags, world_size=world_size)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_missing_data_is_explained():
    with pytest.raises(ConfigError, match="--data-path PREFIX .* or --mock-data"):
        parse_config([], world_size=1)


def test_cli_rejects_invalid_layout_without_traceback():
    result = subprocess.run(
        [sys.executable, str(ROOT / "pretrain_gpt.py"), *MOCK, "--tensor-model-parallel-size", "3"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "error: --num-attention-heads 4 is not divisible by --tensor-model-parallel-size 3"
    )
    assert "Traceback" not in result.stdout + result.stderr
