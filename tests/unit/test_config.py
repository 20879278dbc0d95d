"""The dataclass config is the single source of the CLI flags, and bad values fail with one line."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from megatron_like.config import Config, ConfigError, build_parser, field_docstrings, parse_config

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


def test_parses_in_one_process_share_nothing_but_the_parser_and_name_their_program(monkeypatch, capsys):
    """parse_config keeps one parser per program name: a config's list (a default the parser holds) is its own, a
    repeatable flag of one parse is not in the next, and a bad flag's hint names the program running now (a parser
    kept for another would name that one)."""
    assert len(parse_config(MOCK + ["--inject-fault", "nan_loss@2", "--inject-fault", "slow@1:1"])
               .resilience.inject_fault) == 2
    parse_config(MOCK).resilience.inject_fault.append("nan_loss@3")
    assert parse_config(MOCK).resilience.inject_fault == []
    for program in ("pretrain_gpt.py", "pretrain_vit.py"):
        monkeypatch.setattr("sys.argv", [f"/some/dir/{program}"])
        with pytest.raises(SystemExit):
            parse_config(MOCK + ["--no-such-flag"])
        assert capsys.readouterr().err.strip().endswith(f"(see {program} --help)")


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
    from tests.e2e.cli import run_script  # `python pretrain_gpt.py ...` as from a shell, forked: no torch import

    result = run_script("pretrain_gpt.py", *MOCK, "--tensor-model-parallel-size", "3", check=False, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "error: --num-attention-heads 4 is not divisible by --tensor-model-parallel-size 3"
    )
    assert "Traceback" not in result.stdout + result.stderr


# ---------------------------------------------------------------- declarations on the fields (config/fields.py)
def _numeric_fields():
    """(group class, field, its base type) of every int or float flag of every group."""
    from megatron_like.config.cli import _unwrap_optional

    for group_cls in (type(g) for g in Config().groups().values()):
        hints = typing.get_type_hints(group_cls)
        for f in dataclasses.fields(group_cls):
            tp = _unwrap_optional(hints[f.name])
            if tp in (int, float):
                yield group_cls, f.name, tp


def _outside(rule, tp) -> list:
    """Values just outside ``rule`` (and the non-finite floats every float range refuses)."""
    step = 1 if tp is int else 0.5
    values = []
    if rule.min is not None:
        values.append(tp(rule.min) if rule.min_open else tp(rule.min - step))
    if rule.max is not None:
        values.append(tp(rule.max) if rule.max_open else tp(rule.max + step))
    if tp is float:
        values += [float("nan"), float("inf"), float("-inf")]
    return values


def test_every_numeric_flag_declares_a_range_and_refuses_values_outside_it():
    """Generated from the declarations: each value outside a numeric field's Range is a one-line ConfigError that
    names the flag and the value, before any process group (parse_config starts none)."""
    from megatron_like.config.fields import Range, declared

    checked = 0
    for group_cls, name, tp in _numeric_fields():
        rules = declared(group_cls, name, Range)
        assert len(rules) == 1, (f"{group_cls.__name__}.{name} declares no Range: write it in the annotation, "
                                 f"e.g. `{name}: Annotated[{tp.__name__}, POSITIVE] = ...` (config/fields.py)")
        invalid = _outside(rules[0], tp)
        assert invalid, f"{group_cls.__name__}.{name}: an int range needs a bound (nothing would be refused)"
        flag = "--" + name.replace("_", "-")
        for value in invalid:
            with pytest.raises(ConfigError) as refused:
                parse_config(MOCK + [f"{flag}={value}"])
            message = str(refused.value)
            assert message.startswith(f"{flag} {value} must be ") and "\n" not in message, message
            checked += 1
    assert checked > 60


def _another_value(cls: type, name: str, current: object) -> object:
    """A value of field ``name`` other than ``current`` (valid for its type, not necessarily for the model)."""
    special = {"window_size": "3,0" if current is None else None, "moe_layer_freq": "2" if current == "1" else "1"}
    if name in special:
        return special[name]
    tp = typing.get_type_hints(cls)[name]
    choices = [c for c in typing.get_args(tp) if c is not type(None)]
    if isinstance(current, bool):
        return not current
    if typing.get_origin(choices[0] if choices else tp) is typing.Literal:
        return next(c for c in typing.get_args(choices[0]) if c != current)
    if typing.get_origin(tp) is typing.Literal:
        return next(c for c in typing.get_args(tp) if c != current)
    if str in choices:
        return "given"
    from megatron_like.config.fields import Range, declared

    (rule,) = declared(cls, name, Range)
    if int in choices or tp is int:
        candidates = [96] if current is None else [current * 2 + 1, current - 1]
    else:
        candidates = [0.5] if current is None else [current * 2 + 0.5, current / 2]
    return next(v for v in candidates if v != current and rule.contains(v))


def test_every_needed_flag_is_refused_without_what_it_needs():
    """Generated from the declarations: each field given (off its default) without the flag its Requires names is
    a one-line ConfigError naming both."""
    from megatron_like.config.fields import _SET, Requires, check_declared, declared

    checked = 0
    for group_name, group in Config().groups().items():
        for f in dataclasses.fields(type(group)):
            needs = declared(type(group), f.name, Requires)
            for need in needs:
                config, given = Config(), {f.name}
                setattr(getattr(config, group_name), f.name, _another_value(type(group), f.name, f.default))
                for other in needs:  # meet the field's other needs, so that this one is the one missing
                    if other is not need:
                        owner, _, target = other.field.rpartition(".")
                        target_group = getattr(config, owner or group_name)
                        value = other.value if other.value is not _SET else _another_value(
                            type(target_group), target, getattr(target_group, target))
                        setattr(target_group, target, value)
                        given.add(target)
                with pytest.raises(ConfigError) as refused:
                    check_declared(config.groups())
                message = str(refused.value)
                assert message.split()[0] in {"--" + n.replace("_", "-") for n in given}, message
                assert message.endswith(f"needs {need.describe()}"), message
                checked += 1
    assert checked > 15
