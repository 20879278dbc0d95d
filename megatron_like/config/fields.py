"""What a config field declares beside its type, in its annotation: the range of its values, the flag it needs,
and how a checkpoint's value of it is compared with this run's.

    num_layers: Annotated[int, MUST_MATCH, POSITIVE] = 2
    \"\"\"Number of transformer layers.\"\"\"

These declarations are the single source of truth: ``check_declared`` applies every range and dependency before
any process group starts, and ``megatron_like.config.compare`` compares a checkpoint with this run by them (at
resume, ``--finetune``, conversion and generation). Every ``ModelConfig`` field must carry one of the four
comparison rules (a test walks them); every int or float field of every group must carry a ``Range`` (a test
generates invalid values from it).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from dataclasses import dataclass
from typing import Literal

from megatron_like.config.errors import ConfigError, flag_name

# ---------------------------------------------------------------- ranges


@dataclass(frozen=True)
class Range:
    """Valid values of a numeric field (None is always allowed for an optional field: it means "not given").

    Floats must also be finite: no flag here means anything by ``inf`` or ``nan``."""

    min: float | None = None
    max: float | None = None
    min_open: bool = False
    """True: the value must be greater than ``min`` (not equal)."""
    max_open: bool = False
    """True: the value must be less than ``max`` (not equal)."""

    def contains(self, value: float) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if self.min is not None and (value <= self.min if self.min_open else value < self.min):
            return False
        return not (self.max is not None and (value >= self.max if self.max_open else value > self.max))

    def describe(self) -> str:
        """The rule in words: "positive", "at least 0", "in [0, 1)", "a finite number"."""
        low, high = _plain(self.min), _plain(self.max)
        if self.max is None:
            if self.min == 0:
                return "positive" if self.min_open else "at least 0"
            if self.min is None:
                return "a finite number"
            return f"{'greater than' if self.min_open else 'at least'} {low}"
        if self.min is None:
            return f"{'less than' if self.max_open else 'at most'} {high}"
        return f"in {'(' if self.min_open else '['}{low}, {high}{')' if self.max_open else ']'}"


def _plain(bound: float | None) -> str:
    """A bound as written: 4294967295, not 4.29497e+09."""
    return str(bound) if bound is None or isinstance(bound, int) else f"{bound:g}"


POSITIVE = Range(min=0, min_open=True)
NON_NEGATIVE = Range(min=0)
PROBABILITY = Range(min=0, max=1, max_open=True)
"""Dropout rates and Adam's betas: [0, 1)."""


# ---------------------------------------------------------------- dependent flags


_SET = object()


@dataclass(frozen=True)
class Requires:
    """A field that, when given (any value but its default), needs another flag: ``Requires("num_experts")``
    (given at all), ``Requires("position_embedding_type", "rope")`` (that value). A field of another group is
    named ``"group.field"``."""

    field: str
    value: object = _SET

    def satisfied_by(self, value: object) -> bool:
        if self.value is _SET:
            return value is not None and value is not False
        return value == self.value

    def describe(self) -> str:
        flag = flag_name(self.field.split(".")[-1])
        return flag if self.value is _SET else f"{flag} {self.value}"


@dataclass(frozen=True)
class Repeatable:
    """A list field whose flag may be given several times, each adding its values (``--inject-fault a --inject-fault
    b``); a list flag without it takes the values of its last occurrence."""


REPEATABLE = Repeatable()


# ---------------------------------------------------------------- comparison with a checkpoint


@dataclass(frozen=True)
class Compared:
    """How a checkpoint's value of a model field is compared with this run's (``megatron_like.config.compare``).

    ``rule``: "same" must be equal everywhere; "finetune" must be equal on a resume and may differ on
    ``--finetune`` (one line says so); "noticed" may differ on a resume too (one line); "ignored" is not compared,
    for the ``reason`` given. ``via``: compare this property of ModelConfig instead of the raw value (``None`` and
    the value it stands for compute the same)."""

    rule: Literal["same", "finetune", "noticed", "ignored"]
    via: str | None = None
    reason: str = ""

    def through(self, prop: str) -> Compared:
        """The same rule, applied to the property ``prop`` (e.g. ``ffn_size`` for ``ffn_hidden_size``)."""
        return dataclasses.replace(self, via=prop)


MUST_MATCH = Compared("same")
"""Defines the computation: a checkpoint with another value is refused (resume, --finetune, generation), and a
conversion must carry it."""
FINETUNE_MAY_CHANGE = Compared("finetune")
"""Defines the computation, but fine-tuning changes it on purpose (long context: RoPE scaling, the window): refused
on a resume, one line on --finetune."""
MAY_CHANGE = Compared("noticed")
"""Training-time only (dropout, loss weights, the sequence length of the samples): may change on a resume, with
one line."""


def NotCompared(reason: str) -> Compared:  # noqa: N802 (reads as a marker, like the constants above)
    """Not compared with a checkpoint, for ``reason`` (e.g. a fused kernel of the same formula)."""
    return Compared("ignored", reason=reason)


# ---------------------------------------------------------------- reading the declarations


@functools.cache
def declarations(cls: type) -> dict[str, tuple[object, ...]]:
    """``{field: (Range, Requires, Compared markers...)}`` of a config dataclass, from its annotations."""
    hints = typing.get_type_hints(cls, include_extras=True)
    return {f.name: getattr(hints[f.name], "__metadata__", ()) for f in dataclasses.fields(cls)}


def declared(cls: type, name: str, kind: type) -> list:
    """The markers of type ``kind`` on field ``name`` of ``cls``."""
    return [marker for marker in declarations(cls)[name] if isinstance(marker, kind)]


def comparison_of(cls: type, name: str) -> Compared | None:
    """The comparison rule of a field, or None when it declares none."""
    found = declared(cls, name, Compared)
    return found[0] if found else None


def _field_default(cls: type, name: str) -> object:
    f = cls.__dataclass_fields__[name]
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def check_declared(groups: dict[str, object]) -> None:
    """Raise ConfigError (one line) for the first value outside its field's Range, then for the first given flag
    whose Requires is not met; ``groups`` is ``Config.groups()``."""
    for group in groups.values():
        for name in declarations(type(group)):
            value = getattr(group, name)
            for rule in declared(type(group), name, Range):
                if value is not None and not isinstance(value, bool) and not rule.contains(value):
                    raise ConfigError(f"{flag_name(name)} {value} must be {rule.describe()}")
    for group_name, group in groups.items():
        cls = type(group)
        for name in declarations(cls):
            value = getattr(group, name)
            if value == _field_default(cls, name):
                continue
            for need in declared(cls, name, Requires):
                owner, _, target = need.field.rpartition(".")
                if not need.satisfied_by(getattr(groups[owner or group_name], target)):
                    given = flag_name(name) if isinstance(value, bool) else f"{flag_name(name)} {value}"
                    raise ConfigError(f"{given} needs {need.describe()}")
