"""Typed configuration: the single source of truth for every command-line flag.

Each field of the group dataclasses becomes one Megatron-style flag: ``num_layers`` -> ``--num-layers``.
A boolean that defaults to False becomes a switch (``--sequence-parallel``); one that defaults to True
becomes its negation (``load_optim`` -> ``--no-load-optim``). The docstring under a field is its ``--help``.

Validation happens in :meth:`Config.validate`, before any process group starts, and raises
:class:`ConfigError` with one line naming the flag, the value and the rule.

One module per job; each group lives in the module named after its attribute of ``Config``
(``config.model`` is a ``ModelConfig`` from ``model.py``):

- ``model.py``, ``parallel.py``, ``optimizer.py``, ``precision.py``, ``data.py``, ``training.py``,
  ``checkpoint.py``, ``logging.py``, ``resilience.py``: the groups, each with the rules it can check alone;
- ``config.py``: ``Config``, the groups composed, its derived sizes and the rules that span groups;
- ``cli.py``: the flags generated from the fields, parsing, one-line errors and no-effect warnings;
- ``errors.py``: ``ConfigError`` and ``flag_name``.
"""

from megatron_like.config.checkpoint import CheckpointConfig
from megatron_like.config.cli import (
    MEGATRON_SPELLINGS,
    QuietArgumentParser,
    add_group_flags,
    build_parser,
    config_from_namespace,
    field_docstrings,
    no_effect_warnings,
    parse_config,
    parse_config_or_exit,
    print_once,
)
from megatron_like.config.config import LEGACY_FIELDS, Config
from megatron_like.config.data import DataConfig
from megatron_like.config.errors import ConfigError, flag_name
from megatron_like.config.logging import LoggingConfig
from megatron_like.config.model import ModelConfig, parse_moe_layer_freq
from megatron_like.config.optimizer import OptimizerConfig
from megatron_like.config.parallel import ParallelConfig
from megatron_like.config.precision import PrecisionConfig
from megatron_like.config.resilience import ResilienceConfig
from megatron_like.config.training import TrainingConfig

__all__ = [
    "LEGACY_FIELDS",
    "MEGATRON_SPELLINGS",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "PrecisionConfig",
    "QuietArgumentParser",
    "ResilienceConfig",
    "TrainingConfig",
    "add_group_flags",
    "build_parser",
    "config_from_namespace",
    "field_docstrings",
    "flag_name",
    "no_effect_warnings",
    "parse_config",
    "parse_config_or_exit",
    "parse_moe_layer_freq",
    "print_once",
]
