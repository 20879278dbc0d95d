"""Megatron-LM's pipeline step orders, restated independently of ``megatron_like.pipeline_parallel``.

The tests compare the schedules' own step lists and the recorded traces of real runs with these, so a
change to ``schedules.py`` cannot move the order and its oracle together. Written from Megatron-LM's
``megatron/core/pipeline_parallel/schedules.py`` (current main):

* ``forward_backward_pipelining_without_interleaving``: ``num_warmup_microbatches = min(p - rank - 1, m)``;
  then ``m - warmup`` times "forward of micro batch warmup + i, backward of micro batch i"; then the
  remaining backwards.
* ``forward_backward_pipelining_with_interleaving``: a *schedule table* lists (micro batch, chunk) pairs:
  micro batches in groups of ``microbatch_group_size_per_vp_stage`` (default ``p``), each group running
  through chunk 0, chunk 1, ... The k-th forward is table entry k; the k-th backward is table entry k with
  the chunk mirrored (``v - 1 - chunk``). ``num_warmup_microbatches = (p - rank - 1) * 2 + (v - 1) * p``,
  capped at ``m * v`` (then every forward runs before any backward); then ``m * v - warmup`` times
  "forward k + warmup, backward k"; then the remaining backwards. (Megatron releases before the schedule
  table also ran all forwards first when ``m == p``; main dropped that special case, as does this repo.)

Steps are ``(kind, chunk, micro batch)`` tuples with kind ``"F"`` or ``"B"``.
"""

from __future__ import annotations

MegatronStep = tuple[str, int, int]


def megatron_1f1b(p: int, rank: int, m: int, forward_only: bool = False) -> list[MegatronStep]:
    if forward_only:
        return [("F", 0, i) for i in range(m)]
    warmup = min(p - rank - 1, m)
    order = [("F", 0, i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", 0, warmup + i), ("B", 0, i)]
    return order + [("B", 0, i) for i in range(m - warmup, m)]


def schedule_table(m: int, v: int, group: int) -> list[tuple[int, int]]:
    """(micro batch, chunk) of each forward, in order: each group of micro batches visits every chunk."""
    table = []
    for first in range(0, m, group):
        members = range(first, min(first + group, m))
        table += [(microbatch, chunk) for chunk in range(v) for microbatch in members]
    return table


def megatron_interleaved(p: int, rank: int, m: int, v: int, forward_only: bool = False) -> list[MegatronStep]:
    table = schedule_table(m, v, group=p)
    forwards = [("F", chunk, microbatch) for microbatch, chunk in table]
    backwards = [("B", v - 1 - chunk, microbatch) for microbatch, chunk in table]
    if forward_only:
        return forwards
    total = m * v
    warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)
    order = forwards[:warmup]
    for k in range(total - warmup):
        order += [forwards[warmup + k], backwards[k]]
    return order + backwards[total - warmup:]


def megatron_order(p: int, rank: int, m: int, v: int, forward_only: bool = False) -> list[MegatronStep]:
    """The order of rank ``rank`` of ``p`` stages with ``v`` chunks each over ``m`` micro batches."""
    if v == 1:
        return megatron_1f1b(p, rank, m, forward_only)
    return megatron_interleaved(p, rank, m, v, forward_only)
