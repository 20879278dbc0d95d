"""The command line, generated from the config dataclasses: one flag per field, its ``--help`` the docstring
under the field; Megatron-LM's other spellings; parsing, one-line errors and no-effect warnings.

A boolean that defaults to False becomes a switch (``--sequence-parallel``); one that defaults to True becomes
its negation (``load_optim`` -> ``--no-load-optim``).
"""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import functools
import inspect
import os
import sys
import textwrap
import types
import typing
from typing import Literal

from megatron_like.config.config import Config, _group_classes
from megatron_like.config.errors import ConfigError, flag_name
from megatron_like.config.fields import Repeatable, declared


@functools.cache
def _class_bodies(module_name: str) -> dict[str, list[ast.stmt]]:
    """The statements of each top-level class of a module, by class name, from one parse of its source.

    Parsed once per process: ``inspect.getsource(cls)`` parses the whole file again for every class (~0.14 s of
    CPU per ``build_parser()`` when the groups shared one file), and every rank of every run parses the command
    line."""
    tree = ast.parse(inspect.getsource(sys.modules[module_name]))
    return {node.name: node.body for node in tree.body if isinstance(node, ast.ClassDef)}


def field_docstrings(cls: type) -> dict[str, str]:
    """Map each field of a dataclass to the string literal written under it in the source."""
    body = _class_bodies(cls.__module__).get(cls.__qualname__)
    if body is None:  # not a top-level class of its module
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for node, following in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def _unwrap_optional(tp: object) -> object:
    """``int | None`` (or ``Optional[int]``) -> ``int``."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


MEGATRON_SPELLINGS = {
    "override_opt_param_scheduler": "--override-opt_param-scheduler",
    "use_checkpoint_opt_param_scheduler": "--use-checkpoint-opt_param-scheduler",
}
"""Flags Megatron-LM spells with an underscore; both spellings are accepted."""


def add_group_flags(parser: argparse.ArgumentParser, group_name: str, group_cls: type) -> None:
    """Add one flag per field of ``group_cls`` to ``parser``, in an argument group named ``group_name``; a
    flag's value lands in the namespace under ``"<group_name>.<field>"`` (read back by config_from_namespace)."""
    arg_group = parser.add_argument_group(group_name, group_cls.__doc__)
    docs = field_docstrings(group_cls)
    hints = typing.get_type_hints(group_cls)
    for f in dataclasses.fields(group_cls):
        tp = _unwrap_optional(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        help_text = docs.get(f.name, "")
        dest = f"{group_name}.{f.name}"
        if tp is bool:
            if default:
                arg_group.add_argument(
                    "--no-" + f.name.replace("_", "-"), dest=dest, action="store_false", help=help_text
                )
                # Also accept the positive form, which some Megatron scripts pass explicitly.
                arg_group.add_argument(flag_name(f.name), dest=dest, action="store_true", help=argparse.SUPPRESS)
            else:
                spellings = [flag_name(f.name)] + ([MEGATRON_SPELLINGS[f.name]] if f.name in MEGATRON_SPELLINGS else [])
                arg_group.add_argument(*spellings, dest=dest, action="store_true", help=help_text)
            parser.set_defaults(**{dest: default})
            continue
        kwargs: dict = {
            "dest": dest,
            "default": default,
            "metavar": f.name.upper(),
            "help": f"{help_text} (default: {default})",
        }
        if typing.get_origin(tp) is Literal:
            kwargs["choices"] = list(typing.get_args(tp))
        elif typing.get_origin(tp) is list:
            kwargs["nargs"] = "+"
            kwargs["type"] = typing.get_args(tp)[0]
            if declared(group_cls, f.name, Repeatable):
                kwargs["action"] = "extend"
        else:
            kwargs["type"] = tp
        arg_group.add_argument(flag_name(f.name), **kwargs)


def _add_legacy_aliases(parser: argparse.ArgumentParser) -> None:
    """Older Megatron-LM spellings that scripts still pass; each sets a field of a config dataclass."""
    parser.add_argument("--layernorm-epsilon", dest="model.norm_epsilon", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--use-rotary-position-embeddings", dest="model.position_embedding_type",
                        action="store_const", const="rope", help=argparse.SUPPRESS)


# ---------------------------------------------------------------- argument errors: one line, printed once


def print_once(message: str, file: typing.TextIO | None = None) -> None:
    """Print ``message`` to ``file`` (default stderr) on global rank 0 only (every rank of a launch parses the same
    flags)."""
    if os.environ.get("RANK", "0") == "0":
        print(message, file=file or sys.stderr, flush=True)


class QuietArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad command line prints one line (rank 0) with a ``--help`` hint, not the usage."""

    def error(self, message: str) -> typing.NoReturn:
        print_once(f"error: {message} (see {self.prog} --help)")
        raise SystemExit(2)

    def parse_known_args(self, args: typing.Sequence[str] | None = None,
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        """argparse takes ``-1e-8`` or ``-1,0`` for an option (its negative numbers are plain decimals): glue such a
        value to the flag before it (``--adam-eps=-1e-8``), so that it reaches the range check."""
        args = list(sys.argv[1:] if args is None else args)
        glued: list[str] = []
        for token in args:
            if glued and glued[-1].startswith("--") and "=" not in glued[-1] and _is_negative_number(token):
                glued[-1] = f"{glued[-1]}={token}"
            else:
                glued.append(token)
        return super().parse_known_args(glued, namespace)


def _is_negative_number(token: str) -> bool:
    """``-1e-8``, ``-inf``, ``-1,0`` (a --window-size): a value, never a flag (no flag starts with a digit)."""
    if token[:2] in ("-.",) or (len(token) > 1 and token[0] == "-" and token[1].isdigit()):
        return True
    try:
        float(token)
    except ValueError:
        return False
    return token.startswith("-")


def no_effect_warnings(config: Config) -> list[str]:
    """Flags that change nothing in this layout: one line each (warnings, as Megatron: the run is valid)."""
    p, warnings = config.parallel, []
    if p.sequence_parallel and p.tensor_model_parallel_size == 1:
        warnings.append("--sequence-parallel has no effect with --tensor-model-parallel-size 1")
    if p.overlap_grad_reduce and config.data_parallel_size == 1:
        warnings.append("--overlap-grad-reduce has no effect with one data-parallel rank (no gradient reduction)")
    if p.overlap_param_gather and config.data_parallel_size == 1:
        warnings.append("--overlap-param-gather has no effect with one data-parallel rank (no parameter gather)")
    if config.checkpoint.save_interval and not config.checkpoint.save:
        warnings.append("--save-interval has no effect without --save")
    m = config.model
    etp_is_tp = p.expert_tensor_parallel_size in (None, p.tensor_model_parallel_size)  # else tokens move over etp
    if m.num_experts is not None and p.expert_model_parallel_size == 1 and etp_is_tp \
            and m.moe_token_dispatcher_type == "alltoall":
        warnings.append("--moe-token-dispatcher-type alltoall has no effect with --expert-model-parallel-size 1")
    if m.num_experts is not None and m.moe_router_pre_softmax and m.moe_router_score_function == "sigmoid":
        warnings.append("--moe-router-pre-softmax has no effect with --moe-router-score-function sigmoid")
    if config.data.eod_mask_loss and config.data.mock_data:
        warnings.append("--eod-mask-loss has no effect with --mock-data (its tokens have no end-of-document id)")
    if config.data.reset_position_ids and m.position_embedding_type != "learned_absolute":
        warnings.append(f"--reset-position-ids has no effect with --position-embedding-type {m.position_embedding_type}"
                        " (only learned absolute positions read the position ids)")
    return warnings


def build_parser(description: str = "Megatron-style GPT pretraining") -> argparse.ArgumentParser:
    """An argparse parser with one flag per config field (Megatron-LM's names)."""
    parser = QuietArgumentParser(description=description, allow_abbrev=False)
    for group_name, group_cls in _group_classes().items():
        add_group_flags(parser, group_name, group_cls)
    _add_legacy_aliases(parser)
    return parser


@functools.cache
def _parser_of(prog: str) -> argparse.ArgumentParser:
    """``build_parser()`` for the program ``prog`` (its messages name it), built once per process: building reads
    every group's type hints and docstrings (~7 ms of CPU), and every rank of every run parses a command line."""
    return build_parser()


def config_from_namespace(namespace: argparse.Namespace, world_size: int) -> Config:
    values: dict[str, dict] = {}
    for dest, value in vars(namespace).items():
        if "." in dest:
            group, name = dest.split(".", 1)
            # A copy: a default (a list of a default_factory) is the parser's own object, shared between parses.
            values.setdefault(group, {})[name] = copy.copy(value)
    config = Config.from_dict(values)
    config.world_size = world_size
    return config


def parse_config(argv: list[str] | None = None, world_size: int | None = None) -> Config:
    """Parse and validate the command line; the world size comes from the launcher's WORLD_SIZE."""
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    namespace = _parser_of(os.path.basename(sys.argv[0])).parse_args(argv)
    return config_from_namespace(namespace, world_size).validate()


def parse_config_or_exit(
    argv: list[str] | None = None, extra_check: typing.Callable[[Config], None] | None = None
) -> Config:
    """Like parse_config (then ``extra_check``, e.g. an entry point's own rules), but a ConfigError prints
    one line and exits with status 2 (no traceback)."""
    try:
        config = parse_config(argv)
        if extra_check is not None:
            extra_check(config)
    except ConfigError as error:
        print_once(f"error: {error}")
        raise SystemExit(2) from None
    for warning in no_effect_warnings(config):
        print_once(f"warning: {warning}")
    return config
