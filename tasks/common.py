"""Command-line parsing shared by the task entry points (classification fine-tuning, ViT).

A task adds its own small dataclass of flags (a field with a docstring under it = one flag, exactly as
``megatron_like.config``) to the Megatron flags. :func:`parse_task_args` returns the unvalidated
``Config`` and the task's dataclass, so the entry point can derive sizes (sequence length from the image
size, iterations from epochs) before ``Config.validate`` checks everything.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any, TypeVar

from megatron_like.config import (
    Config,
    ConfigError,
    add_group_flags,
    build_parser,
    config_from_namespace,
    print_once,
)

TaskConfig = TypeVar("TaskConfig")


def parse_task_args(argv: list[str] | None, task_cls: type[TaskConfig], description: str,
                    defaults: dict[str, Any] | None = None) -> tuple[Config, TaskConfig]:
    """Parse Megatron flags plus ``task_cls``'s flags; ``defaults`` maps ``group.field`` to a new default."""
    parser = build_parser(description)
    add_group_flags(parser, "task", task_cls)
    if defaults:
        parser.set_defaults(**defaults)
    namespace = parser.parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    config = config_from_namespace(namespace, world_size)
    fields = {f.name for f in dataclasses.fields(task_cls)}
    task = task_cls(**{k[len("task."):]: v for k, v in vars(namespace).items()
                       if k.startswith("task.") and k[len("task."):] in fields})
    return config, task


def run_or_exit(check: Callable[[], Any]) -> Any:
    """Run ``check``; a ConfigError prints one line (rank 0) and exits with status 2, as pretrain_gpt.py does."""
    try:
        return check()
    except ConfigError as error:
        print_once(f"error: {error}")
        raise SystemExit(2) from None


def print_last_rank(message: str) -> None:
    """Print on the last rank (the one that holds the loss), like Megatron's log lines."""
    if int(os.environ.get("RANK", "0")) == int(os.environ.get("WORLD_SIZE", "1")) - 1:
        print(message, flush=True)
