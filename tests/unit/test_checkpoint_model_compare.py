"""A checkpoint's model is compared with this run's by the rule each ModelConfig field declares (config/fields.py):
every field declares one, every compared field's change is seen, and resume (both formats), --finetune, the
inference tools and the Hugging Face conversion apply them."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import os
import sys

import pytest
import torch

from megatron_like.config import ModelConfig
from megatron_like.config.compare import model_changes
from megatron_like.config.fields import comparison_of
from megatron_like.training.checkpointing import CheckpointError
from tests.distributed.gpt_runs import train_gpt
from tests.unit.test_config import _another_value

FIELDS_DOC = "megatron_like/config/fields.py"


def tool(name: str):
    """A module of tools/ (a directory of scripts, not a package)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def test_every_model_field_declares_how_a_checkpoint_compares_it():
    for f in dataclasses.fields(ModelConfig):
        compared = comparison_of(ModelConfig, f.name)
        assert compared is not None, (
            f"ModelConfig.{f.name} does not say how a checkpoint's value is compared with this run's: add one of "
            f"MUST_MATCH, FINETUNE_MAY_CHANGE, MAY_CHANGE or NotCompared(\"why\") to its annotation, e.g. "
            f"`{f.name}: Annotated[<its type>, MUST_MATCH] = ...` ({FIELDS_DOC})")
        if compared.rule == "ignored":
            assert len(compared.reason) > 20, f"ModelConfig.{f.name}: NotCompared needs a reason a reader can check"
        if compared.via is not None:
            assert hasattr(ModelConfig(), compared.via), f"ModelConfig.{f.name}: no property {compared.via!r}"


# Every optional feature on, so that each field's change reaches the property it is compared through.
FULL = ModelConfig(num_experts=4, disable_bias_linear=True, position_embedding_type="rope", group_query_attention=True,
                   num_query_groups=2, use_rope_scaling=True, moe_expert_capacity_factor=1.0)


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(ModelConfig)])
def test_a_change_of_every_compared_field_is_seen_and_no_other(name):
    changed = dataclasses.replace(FULL, **{name: _another_value(ModelConfig, name, getattr(FULL, name))})
    seen = {change.name: change.rule for change in model_changes(FULL, changed)}
    rule = comparison_of(ModelConfig, name).rule
    if rule == "ignored":
        assert seen == {}, f"{name} is NotCompared but its change was seen as {seen}"
    else:
        assert seen.get(name) == rule, f"{name} ({rule}) changed but the comparison saw {seen}"


def test_a_value_and_the_default_it_stands_for_are_the_same_model():
    """Fields compared through a property: an explicit value equal to what the default stands for is no change."""
    default = ModelConfig()
    explicit = dataclasses.replace(default, ffn_hidden_size=4 * default.hidden_size, window_size="(-1,0)",
                                   max_position_embeddings=default.seq_length, group_query_attention=True,
                                   num_query_groups=default.num_attention_heads, kv_channels=default.head_dim)
    assert model_changes(default, explicit) == []


# ---------------------------------------------------------------- the rules applied, on real checkpoints
LLAMA = ["--num-layers", "2", "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--train-iters", "1"]
SAVED = LLAMA + ["--window-size", "7,0", "--qat"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, str]:
    """One iteration of a windowed QAT Llama-style model, saved in each checkpoint format."""
    roots = {}
    for fmt in ("torch", "torch_dist"):
        roots[fmt] = str(tmp_path_factory.mktemp(fmt))
        with contextlib.redirect_stdout(io.StringIO()):
            train_gpt(0, 1, SAVED + ["--ckpt-format", fmt, "--save", roots[fmt]])
    return roots


def run_from(root: str, flags: list[str]) -> str:
    """stdout of a 2-iteration run loading ``root``."""
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        train_gpt(0, 1, flags + ["--train-iters", "2", "--lr-decay-iters", "1", "--load", root])
    return log.getvalue()


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_resume_refuses_a_forgotten_window_or_rope_scaling_and_any_other_architecture(saved, fmt):
    for flags, refused in [
        (LLAMA + ["--qat"], "has --window-size 7,0 but this run has None; pass the checkpoint's value (or --finetune"),
        (SAVED + ["--use-rope-scaling"], "has --use-rope-scaling False but this run has True"),
        (SAVED + ["--rotary-base", "500000"], "has --rotary-base 10000 but this run has 500000"),
        (LLAMA + ["--window-size", "7,0"], "has --qat True but this run has False"),
        (SAVED + ["--finetune", "--norm-epsilon", "1e-6"], "has --norm-epsilon 1e-05 but this run has 1e-06; pass "
                                                            "the checkpoint's value"),
    ]:
        with pytest.raises(CheckpointError) as error:
            run_from(saved[fmt], flags)
        assert refused in str(error.value) and "\n" not in str(error.value), (flags, str(error.value))


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_finetune_says_in_one_line_what_it_changes(saved, fmt):
    out = run_from(saved[fmt], LLAMA + ["--qat", "--finetune", "--rotary-seq-len-interpolation-factor", "2"])
    (line,) = [line for line in out.splitlines() if line.startswith(" > fine-tuning with changed model arguments")]
    assert line.startswith(" > fine-tuning with changed model arguments: --rotary-seq-len-interpolation-factor "
                           "None -> 2.0, --window-size 7,0 -> None: "), line


def test_resume_says_what_changed_for_a_training_time_field(saved):
    out = run_from(saved["torch_dist"], SAVED + ["--hidden-dropout", "0.2"])
    (line,) = [line for line in out.splitlines() if line.startswith(" > resuming with changed arguments")]
    assert "--hidden-dropout 0.0 -> 0.2" in line, line


def test_inference_tools_refuse_a_model_flag_the_checkpoint_contradicts(saved):
    from megatron_like.inference import cli
    from megatron_like.parallel_state import ParallelState
    build_parser = tool("generate").build_parser
    ps = ParallelState.single_process(torch.device("cpu"))
    _, config = cli.parse(build_parser(), ["--load", saved["torch_dist"], "--window-size", "15,0"])
    with pytest.raises(ValueError, match=r"^--window-size 15,0 differs from the checkpoint's 7,0: the model is built "):
        cli.load(config, ps)
    _, config = cli.parse(build_parser(), ["--load", saved["torch_dist"], "--window-size", "7,0", "--qat"])
    assert cli.load(config, ps).config.model.window_size == "7,0"  # flags that agree are fine


def test_conversion_refuses_a_field_hugging_face_cannot_hold(saved, tmp_path, capsys):
    convert_hf = tool("convert_hf")
    with pytest.raises(SystemExit) as stopped:
        convert_hf.main(["to-hf", "--load", saved["torch_dist"], "--save", str(tmp_path / "hf")])
    err = capsys.readouterr().err.strip()
    assert stopped.value.code == 1 and err == (
        "error: this checkpoint's --qat True has no equivalent in MistralForCausalLM (it reads back as False); the "
        "converted model would compute something else"), err
