"""A checkpoint's model against this run's, by the comparison rule each ModelConfig field declares
(``fields.py``: MUST_MATCH, FINETUNE_MAY_CHANGE, MAY_CHANGE, NotCompared).

Used by the resume and ``--finetune`` of both checkpoint formats (``training/checkpointing.py``, ``resume.py``),
by the inference tools (a model flag given on their command line must agree with the checkpoint) and by the
Hugging Face conversion (every compared field must survive the trip to the Hugging Face config and back).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_like.config.errors import flag_name
from megatron_like.config.fields import comparison_of
from megatron_like.config.model import ModelConfig


@dataclass(frozen=True)
class ModelChange:
    """One compared field whose value differs between a checkpoint (``saved``) and this run (``new``)."""

    name: str
    rule: str
    saved: object
    new: object

    def __str__(self) -> str:
        return f"{flag_name(self.name)} {self.saved} -> {self.new}"


def saved_model_config(saved_model: dict) -> ModelConfig:
    """The ModelConfig of a checkpoint's saved ``config["model"]`` (older checkpoints: defaults, renamed fields)."""
    from megatron_like.config.config import Config  # it imports this package's groups

    return Config.from_dict({"model": saved_model}).model


def model_changes(saved: ModelConfig, new: ModelConfig, rules: tuple[str, ...] = ("same", "finetune", "noticed")
                  ) -> list[ModelChange]:
    """Every field whose rule is in ``rules`` and whose value differs (and, for a field compared through a property,
    also that property: ``None`` and the size it stands for are the same), in field order."""
    changes = []
    for f in dataclasses.fields(ModelConfig):
        compared = comparison_of(ModelConfig, f.name)
        if compared is None or compared.rule not in rules:
            continue
        old_value, new_value = getattr(saved, f.name), getattr(new, f.name)
        # Through a property, both must differ: equal raw values that differ there differ by another field (named
        # on its own), and None equals the size it stands for.
        via = compared.via
        if old_value != new_value and (via is None or getattr(saved, via) != getattr(new, via)):
            changes.append(ModelChange(f.name, compared.rule, old_value, new_value))
    return changes


def refused_model_change(saved_model: dict, new: ModelConfig, finetune: bool) -> str | None:
    """Why this run may not load a checkpoint's model (its first refused difference), or None.

    MUST_MATCH fields must be equal; FINETUNE_MAY_CHANGE ones too, unless ``finetune``."""
    for change in model_changes(saved_model_config(saved_model), new, ("same", "finetune")):
        if change.rule == "finetune" and finetune:
            continue
        hint = " (or --finetune: a new run from its weights with this value)" if change.rule == "finetune" else ""
        return (f"has {flag_name(change.name)} {change.saved} but this run has {change.new}; pass the "
                f"checkpoint's value{hint}")
    return None


def allowed_model_changes(saved_model: dict, new: ModelConfig, finetune: bool) -> list[ModelChange]:
    """The differences a run may load with, each to be said in the notice line: MAY_CHANGE fields, and with
    ``finetune`` the FINETUNE_MAY_CHANGE ones."""
    rules = ("noticed", "finetune") if finetune else ("noticed",)
    return model_changes(saved_model_config(saved_model), new, rules)


def given_flag_conflicts(saved: ModelConfig, given: ModelConfig) -> str | None:
    """For tools that build the model from the checkpoint's config: a compared model flag given on their command
    line (not at its default) that the checkpoint contradicts, as one line; None when there is none."""
    defaults = ModelConfig()
    for change in model_changes(saved, given, ("same", "finetune")):
        if getattr(given, change.name) != getattr(defaults, change.name):
            return (f"{flag_name(change.name)} {change.new} differs from the checkpoint's {change.saved}: the model "
                    "is built from the checkpoint's config; drop the flag (fine-tune with --finetune to change it)")
    return None


def lost_in_conversion(model: ModelConfig, read_back: ModelConfig, target: str) -> str | None:
    """A compared field that does not survive the conversion to ``target`` and back (``read_back``), as one line;
    None when the converted model computes what ``model`` computes."""
    for change in model_changes(model, read_back, ("same", "finetune")):
        return (f"this checkpoint's {flag_name(change.name)} {change.saved} has no equivalent in {target} (it reads "
                f"back as {change.new}); the converted model would compute something else")
    return None
