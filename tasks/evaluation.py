"""Evaluate a classifier on every sample of a dataset exactly once, in any parallel layout.

:func:`evaluate_dataset` runs the forward-only pipeline schedule over the dataset in global batches (the
last one padded with copies of sample 0 whose ``valid`` flag is 0), sums the per-micro-batch counts
returned by the task's loss function over micro batches and data-parallel ranks, and returns accuracy,
mean loss and (binary tasks) F1 of the positive class. The counts are exact, so the numbers do not depend
on the layout or the batch size.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import default_collate

from megatron_like import collectives as comm
from megatron_like.config import Config
from megatron_like.parallel_state import ParallelState
from megatron_like.training.loop import forward_only_stats


def classification_counts(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
                          positive_class: int = 1) -> dict[str, torch.Tensor]:
    """Sums over the valid samples of ``logits [b, c]`` / ``labels [b]`` / ``valid [b]`` (1 real, 0 padding):
    count, correct, summed cross-entropy, and true/false positives and false negatives of ``positive_class``.
    """
    valid = valid.float()
    predictions = logits.argmax(dim=-1)
    losses = F.cross_entropy(logits.float(), labels, reduction="none")
    is_pred, is_true = (predictions == positive_class).float(), (labels == positive_class).float()
    return {
        "count": valid.sum(),
        "correct": ((predictions == labels).float() * valid).sum(),
        "loss_sum": (losses * valid).sum().detach(),
        "tp": (is_pred * is_true * valid).sum(),
        "fp": (is_pred * (1 - is_true) * valid).sum(),
        "fn": ((1 - is_pred) * is_true * valid).sum(),
    }


def metrics_from_counts(counts: dict[str, float], binary: bool) -> dict[str, float]:
    """Accuracy, mean loss and (binary) F1 from summed counts."""
    n = max(counts["count"], 1.0)
    out = {"accuracy": counts["correct"] / n, "loss": counts["loss_sum"] / n, "samples": counts["count"]}
    if binary:
        denominator = 2 * counts["tp"] + counts["fp"] + counts["fn"]
        out["f1"] = 2 * counts["tp"] / denominator if denominator > 0 else 0.0
    return out


def _micro_batches(dataset: Any, ps: ParallelState, micro_batch_size: int, num_batches: int,
                   global_batch_size: int) -> Iterator[dict[str, torch.Tensor]]:
    """This dp rank's micro batches (PretrainingSampler's layout), samples past the end marked ``valid = 0``."""
    n = len(dataset)
    for first in range(0, num_batches * global_batch_size, micro_batch_size * ps.dp_size):
        start = first + ps.dp_rank * micro_batch_size
        samples = []
        for index in range(start, start + micro_batch_size):
            sample = dict(dataset[index if index < n else 0])
            sample["valid"] = torch.tensor(1.0 if index < n else 0.0)
            samples.append(sample)
        yield default_collate(samples)


def evaluate_dataset(config: Config, ps: ParallelState, model: list[nn.Module], forward_step_func: Callable,
                     dataset: Any, binary: bool) -> dict[str, float]:
    """Metrics over all of ``dataset`` (last pipeline stage; other stages return ``{}``).

    ``forward_step_func(data_iterator, chunk)`` must return a loss function whose stats are
    :func:`classification_counts` (it sees the batch's ``valid`` flags).
    """
    gbs = config.global_batch_size
    num_batches = math.ceil(len(dataset) / gbs)
    iterator = _micro_batches(dataset, ps, config.training.micro_batch_size, num_batches, gbs)
    stats = forward_only_stats(config, ps, forward_step_func, iterator, model, num_batches)
    if not stats:
        return {}
    names = sorted(stats[0])
    sums = torch.stack([torch.stack([s[name].double() for s in stats]).sum() for name in names])
    comm.all_reduce(sums, ps.dp_group)
    return metrics_from_counts(dict(zip(names, sums.tolist())), binary)
