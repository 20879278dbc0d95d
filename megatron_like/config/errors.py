"""ConfigError, and the one-line check every group's ``validate`` raises it with.

``flag_name`` spells a field as its flag, for error messages and for the parser (``cli.py``).
"""

from __future__ import annotations


class ConfigError(ValueError):
    """An invalid flag value or combination; the message is one line meant for the user."""


def flag_name(field_name: str) -> str:
    """``tensor_model_parallel_size`` -> ``--tensor-model-parallel-size``."""
    return "--" + field_name.replace("_", "-")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)
