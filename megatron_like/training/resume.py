"""What changes when a run resumes with other arguments than its checkpoint was saved with.

Some flags may differ on resume by design: the length of the run, the lr schedule, the batch size,
the sequence length, the seed. Each has a consequence a user should not have to guess, so the resume
prints one line naming the changed flags and what follows:

* the lr schedule (``--lr``, ``--min-lr``, warmup, ``--lr-decay-iters``/``--train-iters``, style): the step
  count always comes from the checkpoint; the schedule is recomputed from this run's flags
  (``--override-opt_param-scheduler``, the default here) or kept as the checkpoint's
  (``--use-checkpoint-opt_param-scheduler``). Megatron-LM refuses a mismatch when neither flag is given;
  here the run goes on and says which schedule it follows.
* ``--global-batch-size``, ``--seq-length``, ``--seed``: the data iterator resumes at the consumed sample
  count, but the samples it serves from there differ from the original run's (other batches, other cuts
  of the token stream, another shuffle): the data order changes.
* ``--train-iters``: the run ends at the new iteration count.
"""

from __future__ import annotations

from megatron_like.config import Config, flag_name
from megatron_like.training.lr_schedule import SCHEDULE_KEYS, schedule_values

WATCHED = {
    "training": ("train_iters", "seed"),
    "optimizer": ("lr", "min_lr", "lr_decay_iters", "lr_warmup_iters", "lr_warmup_fraction", "lr_decay_style"),
    "model": ("seq_length",),
}
DATA_ORDER_FLAGS = ("--global-batch-size", "--seq-length", "--seed")


def changed_arguments(saved: Config, config: Config) -> list[tuple[str, object, object]]:
    """``(flag, checkpoint's value, this run's value)`` for every watched flag that differs."""
    changes = []
    for group, names in WATCHED.items():
        for name in names:
            old, new = getattr(getattr(saved, group), name), getattr(getattr(config, group), name)
            if old != new:
                changes.append((flag_name(name), old, new))
    if saved.global_batch_size != config.global_batch_size:
        changes.append(("--global-batch-size", saved.global_batch_size, config.global_batch_size))
    return changes


def resume_notice(saved_config: dict, saved_schedule: dict | None, config: Config) -> str | None:
    """The one line to print when resuming with changed arguments (None when nothing watched changed).

    ``saved_config`` is the checkpoint's ``config`` entry, ``saved_schedule`` its ``scheduler`` entry.
    """
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
    if old_schedule != new_schedule:
        if config.checkpoint.use_checkpoint_opt_param_scheduler:
            follows.append("the lr schedule stays the checkpoint's (--use-checkpoint-opt_param-scheduler)")
        else:
            s = new_schedule
            follows.append(f"the lr schedule is recomputed from this run's flags (warmup {s['warmup_iters']}, "
                           f"{s['decay_style']} decay to {s['min_lr']:g} by iteration {s['decay_iters']}; "
                           "--use-checkpoint-opt_param-scheduler keeps the checkpoint's)")
    if any(flag in DATA_ORDER_FLAGS for flag, _, _ in changes):
        follows.append("the data order changes (the samples from here on differ from the original run's)")
    named = ", ".join(f"{flag} {old} -> {new}" for flag, old, new in changes)
    return f" > resuming with changed arguments: {named}: {'; '.join(follows) or 'nothing else changes'}"
