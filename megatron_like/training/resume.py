"""What changes when a run resumes (or fine-tunes) with other arguments than its checkpoint was saved with.

Some flags may differ on resume by design: the length of the run, the lr schedule, the batch size,
the sequence length, the seed, and the model fields declared MAY_CHANGE (dropout, loss weights; see
``config/fields.py``). Each has a consequence a user should not have to guess, so the resume prints one line
naming the changed flags and what follows:

* the lr schedule (``--lr``, ``--min-lr``, warmup, ``--lr-decay-iters``/``--train-iters``, style): the step
  count always comes from the checkpoint; the schedule's values follow Megatron-LM's rule: with
  ``--override-opt_param-scheduler`` they come from this run's flags, with ``--use-checkpoint-opt_param-scheduler``
  from the checkpoint, and with neither flag a schedule that differs from the checkpoint's is refused (one line
  naming both flags), before any weight is loaded.
* ``--global-batch-size``, ``--seq-length``, ``--seed``: the data iterator resumes at the consumed sample
  count, but the samples it serves from there differ from the original run's (other batches, other cuts
  of the token stream, another shuffle): the data order changes.
* ``--train-iters``: the run ends at the new iteration count.

A ``--finetune`` run starts a new schedule; its line names the model fields it changes on purpose (those declared
FINETUNE_MAY_CHANGE, such as RoPE scaling or the window of long-context fine-tuning, and the MAY_CHANGE ones).
"""

from __future__ import annotations

from megatron_like.config import Config, flag_name
from megatron_like.config.compare import allowed_model_changes, model_changes
from megatron_like.training.lr_schedule import SCHEDULE_KEYS, schedule_values

WATCHED = {
    "training": ("train_iters", "seed"),
    "optimizer": ("lr", "min_lr", "lr_decay_iters", "lr_warmup_iters", "lr_warmup_fraction", "lr_decay_style"),
}
DATA_ORDER_FLAGS = ("--global-batch-size", "--seq-length", "--seed")
SCHEDULER_FLAGS = "--override-opt_param-scheduler (this run's lr flags) or --use-checkpoint-opt_param-scheduler"


def changed_arguments(saved: Config, config: Config) -> list[tuple[str, object, object]]:
    """``(flag, checkpoint's value, this run's value)`` for every watched flag and MAY_CHANGE model field that
    differs."""
    changes = []
    for group, names in WATCHED.items():
        for name in names:
            old, new = getattr(getattr(saved, group), name), getattr(getattr(config, group), name)
            if old != new:
                changes.append((flag_name(name), old, new))
    if saved.global_batch_size != config.global_batch_size:
        changes.append(("--global-batch-size", saved.global_batch_size, config.global_batch_size))
    for change in model_changes(saved.model, config.model, ("noticed",)):
        changes.append((flag_name(change.name), change.saved, change.new))
    return changes


def _lr_defining(schedule: dict) -> dict:
    """The schedule values that set some iteration's lr: a constant schedule never reaches its decay length or its
    minimum (Megatron-LM compares them anyway and refuses a constant-lr run that only trains longer)."""
    if schedule["decay_style"] == "constant":
        return {key: value for key, value in schedule.items() if key not in ("decay_iters", "min_lr")}
    return schedule


def _schedule_follows(old_schedule: dict, new_schedule: dict, config: Config) -> str:
    """What the lr schedule does when this run's flags define another one than the checkpoint's; raises
    CheckpointError when neither scheduler flag says which one to follow (Megatron-LM's rule)."""
    if config.checkpoint.use_checkpoint_opt_param_scheduler:
        return "the lr schedule stays the checkpoint's (--use-checkpoint-opt_param-scheduler)"
    if config.checkpoint.override_opt_param_scheduler:
        s = new_schedule
        return (f"the lr schedule is recomputed from this run's flags (warmup {s['warmup_iters']}, "
                f"{s['decay_style']} decay to {s['min_lr']:g} by iteration {s['decay_iters']}; "
                "--override-opt_param-scheduler)")
    from megatron_like.training.checkpointing import CheckpointError  # it imports this module

    differ = ", ".join(f"{key} {old_schedule[key]} -> {new_schedule[key]}" for key in SCHEDULE_KEYS
                       if old_schedule[key] != new_schedule[key])
    raise CheckpointError(f"this run's lr schedule differs from the checkpoint's ({differ}); pass {SCHEDULER_FLAGS} "
                          "(the checkpoint's schedule)")


def resume_notice(saved_config: dict, saved_schedule: dict | None, config: Config,
                  loads_schedule: bool = True) -> str | None:
    """The one line to print when resuming (or fine-tuning) with changed arguments (None when nothing watched
    changed). Raises CheckpointError for a changed lr schedule without a scheduler flag.

    ``saved_config`` is the checkpoint's ``config`` entry, ``saved_schedule`` its ``scheduler`` entry;
    ``loads_schedule`` False: the caller has no scheduler to load (a tool), so the schedule is not compared.
    """
    if config.checkpoint.finetune:
        tuned = allowed_model_changes(saved_config["model"], config.model, finetune=True)
        if not tuned:
            return None
        return (f" > fine-tuning with changed model arguments: {', '.join(str(change) for change in tuned)}: the "
                "checkpoint's weights now compute with this run's values")
    saved = Config.from_dict(saved_config)
    changes = changed_arguments(saved, config)
    if not changes:
        return None
    if saved_schedule and all(key in saved_schedule for key in SCHEDULE_KEYS):
        old_schedule = {key: saved_schedule[key] for key in SCHEDULE_KEYS}
    else:  # a checkpoint that saved only the step count: its flags define its schedule
        old_schedule = schedule_values(saved.optimizer, saved.training.train_iters)
    new_schedule = schedule_values(config.optimizer, config.training.train_iters)
    follows = []
    if saved.training.train_iters != config.training.train_iters:
        follows.append(f"training ends at iteration {config.training.train_iters}")
    if loads_schedule and _lr_defining(old_schedule) != _lr_defining(new_schedule):
        follows.append(_schedule_follows(old_schedule, new_schedule, config))
    if any(flag in DATA_ORDER_FLAGS for flag, _, _ in changes):
        follows.append("the data order changes (the samples from here on differ from the original run's)")
    named = ", ".join(f"{flag} {old} -> {new}" for flag, old, new in changes)
    return f" > resuming with changed arguments: {named}: {'; '.join(follows) or 'nothing else changes'}"
