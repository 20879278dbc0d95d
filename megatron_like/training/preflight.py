"""Paths checked up front, before any process group starts (a ConfigError of one line each):

* ``--save`` is created if needed and must accept a file (a probe file is written and removed);
* ``--load`` must exist and hold ``latest_checkpointed_iteration.txt`` naming an existing ``iter_``
  directory, unless ``--load`` equals ``--save``: that is the auto-resume pattern of the launch
  scripts, where the first launch finds nothing and starts from scratch (the training loop prints a
  one-line notice);
* every ``--data-path`` prefix (also in a blended ``weight prefix weight prefix`` list) must have both
  its ``.bin`` and its ``.idx`` file (GPT data only: ``check_data_prefixes``).
"""

from __future__ import annotations

import os
import tempfile

from megatron_like.config import CheckpointConfig, ConfigError

TRACKER_FILE = "latest_checkpointed_iteration.txt"


def _same_directory(a: str, b: str | None) -> bool:
    return b is not None and os.path.realpath(a) == os.path.realpath(b)


def check_save_dir(save: str) -> None:
    """``--save`` exists (created here) and is writable by this process."""
    try:
        os.makedirs(save, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"--save {save} cannot be created: {error.strerror or error}; pick a writable "
                          "directory") from None
    try:
        with tempfile.NamedTemporaryFile(dir=save, prefix=".write_probe."):
            pass
    except OSError as error:
        raise ConfigError(f"--save {save} is not writable: {error.strerror or error}; pick a writable "
                          "directory") from None


def check_load_dir(load: str, save: str | None) -> None:
    """``--load`` names a checkpoint (or equals ``--save``, which may not hold one yet)."""
    resume_pattern = _same_directory(load, save)
    tracker = os.path.join(load, TRACKER_FILE)
    if os.path.isfile(load):
        raise ConfigError(f"--load {load} is a file; pass the checkpoint directory (the one holding {TRACKER_FILE} "
                          "and the iter_ directories)")
    if not os.path.exists(tracker):
        if resume_pattern:
            return
        if not os.path.isdir(load):
            raise ConfigError(f"--load {load} does not exist; pass a checkpoint directory (or the same "
                              "directory as --save to resume a run that may not have saved yet)")
        raise ConfigError(f"--load {load} holds no {TRACKER_FILE}: it is not a checkpoint directory (a "
                          "checkpoint is <dir>/iter_XXXXXXX plus that file)")
    from megatron_like.training.checkpointing import CheckpointError, read_tracker  # imports torch

    try:
        iteration = read_tracker(tracker)
    except CheckpointError as error:
        raise ConfigError(str(error)) from None
    iteration_dir = os.path.join(load, f"iter_{iteration:07d}")
    if not os.path.isdir(iteration_dir):
        raise ConfigError(f"{tracker} names iteration {iteration} but {iteration_dir} does not exist; write "
                          "the number of an existing iter_ directory into it")


def check_checkpoint_paths(checkpoint: CheckpointConfig) -> None:
    """The ``--save`` and ``--load`` rules of the module docstring."""
    if checkpoint.save:
        check_save_dir(checkpoint.save)
    if checkpoint.load:
        check_load_dir(checkpoint.load, checkpoint.save)


def check_data_prefixes(data_path: list[str]) -> None:
    """Every prefix of ``--data-path`` (plain or blended) has its ``.bin`` and ``.idx``."""
    from megatron_like.data.blended_dataset import parse_data_path

    try:
        prefixes, _ = parse_data_path(data_path)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    for prefix in prefixes:
        missing = [prefix + ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
        if missing:
            raise ConfigError(f"--data-path prefix {prefix}: {' and '.join(missing)} not found; pass the prefix "
                              "data_tools/preprocess.py wrote (the path without .bin/.idx)")
