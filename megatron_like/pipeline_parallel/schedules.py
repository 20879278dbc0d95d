"""Forward/backward schedules over the micro batches of one global batch.

Every schedule has the same signature and returns the loss statistics of the micro batches it
computed the loss for (only the last pipeline stage has any)::

    schedule(forward_step_func, data_iterator, model, num_microbatches, forward_only=False, *,
             seq_length=None, micro_batch_size=None, trace=None)
        -> list[dict[str, torch.Tensor]]

``forward_step_func(data_iterator, model_chunk) -> (output, loss_func)`` is the Megatron contract:
``loss_func(output) -> (loss, stats)`` with ``loss`` a scalar to backpropagate (averaged over this
micro batch's tokens) and ``stats`` detached scalars for logging. ``model`` is the list of this rank's
model chunks (one per virtual stage). A pipelined chunk exposes ``ps`` (its ParallelState), ``config``
(``hidden_size``, ``seq_length``), ``sequence_parallel`` and ``set_input_tensor(t)``, as GPTModel does.

The schedules:

* :func:`forward_backward_no_pipelining`: one stage, gradient accumulation.
* :func:`forward_backward_pipelining_without_interleaving`: 1F1B. Rank r runs ``pp - r - 1`` warmup
  forwards, then alternates one forward and one backward, then runs the remaining backwards, so it
  holds the activations of at most ``pp - r`` micro batches; they are released by their backward.
* :func:`forward_backward_pipelining_with_interleaving`: 1F1B over ``vp`` model chunks per rank (chunk
  c of rank r is virtual stage ``c * pp + r``). Micro batches go through the chunks in groups of
  ``pp``, which shrinks the bubble from ``(p - 1) / (m + p - 1)`` to ``(p - 1) / (v * m + p - 1)``.
* :func:`forward_backward_pipelining_zero_bubble`: ZB-H1 (``--pipeline-schedule zb-h1``): 1F1B with each
  backward split into B (input gradient) and W (weight gradients), the W steps filling the bubble
  (``zero_bubble.py``).
* :func:`forward_backward_pipelining_zb_v` and :func:`forward_backward_pipelining_dualpipev` (``zb-v``,
  ``dualpipev``): two chunks per rank placed in a V (``placement.py``), the loss on rank 0
  (``v_schedules.py``).

The pipelined schedules are a list of :class:`Step` per rank (:func:`one_f_one_b_steps`,
:func:`interleaved_steps`, :func:`zero_bubble.zb_h1_steps`, ``v_schedules.py``'s) run by one executor,
:func:`run_pipeline_steps`: a step waits for its input (activations from the previous stage for a forward,
the output gradient from the next stage for a backward), computes, and hands its result on. When results
are sent and inputs received is the :func:`communication_plan`, Megatron's batching of p2p operations,
which cannot deadlock even where every batch of a rank runs in order on one stream and waits for its
peers (NCCL).

Every micro-batch loss is divided by ``num_microbatches``: the accumulated gradient is that of the mean
loss over the global batch, and gradients accumulate over micro batches in the same order as without
pipelining.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from megatron_like.config import ConfigError
from megatron_like.config.parallel import check_pipeline_schedule_name
from megatron_like.pipeline_parallel.comm_plan import Post, communication_plan, in_order_plans, interleaved_warmup
from megatron_like.pipeline_parallel.p2p import PipelineP2P, Received, pipeline_tensor_shape
from megatron_like.pipeline_parallel.placement import ChunkPlacement
from megatron_like.pipeline_parallel.trace import ScheduleTrace, Step, StepTiming, active_trace
from megatron_like.pipeline_parallel.v_schedules import dualpipev_steps, zb_v_steps
from megatron_like.pipeline_parallel.zero_bubble import check_weight_steps, zb_h1_steps
from megatron_like.tensor_parallel import weight_grad

LossStats = dict[str, torch.Tensor]
ForwardStepFunc = Callable[[Iterator | None, nn.Module], tuple[torch.Tensor, Callable]]


# ---------------------------------------------------------------- one micro batch
def forward_step(forward_step_func: ForwardStepFunc, data_iterator: Iterator | None, chunk: nn.Module,
                 input_tensor: torch.Tensor | None, num_microbatches: int, is_last_chunk: bool,
                 stats: list[LossStats]) -> torch.Tensor:
    """Run one micro batch through ``chunk``; return its output hidden states ``[s, b, h]``, or on the
    last chunk its loss divided by ``num_microbatches``.

    ``input_tensor`` is ``[s, b, h]`` from the previous stage (None on the first chunk).
    """
    if input_tensor is not None:
        chunk.set_input_tensor(input_tensor)
    output, loss_func = forward_step_func(data_iterator, chunk)
    if input_tensor is not None:
        chunk.set_input_tensor(None)  # the schedule keeps the input as long as its backward needs it
    if not is_last_chunk:
        return output
    loss, micro_stats = loss_func(output)
    stats.append(micro_stats)
    return loss / num_microbatches


def backward_step(input_tensor: torch.Tensor | None, output_tensor: torch.Tensor,
                  output_tensor_grad: torch.Tensor | None) -> torch.Tensor | None:
    """Backpropagate one micro batch through one chunk; return the gradient of its input ``[s, b, h]``.

    ``output_tensor`` is the chunk's output ``[s, b, h]`` with ``output_tensor_grad`` from the next
    stage, or the scalar loss (``output_tensor_grad`` None) on the last chunk.
    """
    torch.autograd.backward(output_tensor, grad_tensors=output_tensor_grad)
    return None if input_tensor is None else input_tensor.grad


# ---------------------------------------------------------------- no pipelining
def forward_backward_no_pipelining(
    forward_step_func: ForwardStepFunc,
    data_iterator: Iterator[Any] | None,
    model: list[nn.Module],
    num_microbatches: int,
    forward_only: bool = False,
    *,
    seq_length: int | None = None,
    micro_batch_size: int | None = None,
    trace: ScheduleTrace | None = None,
) -> list[LossStats]:
    """Gradient accumulation on one stage: forward and backward each micro batch in turn.

    ``seq_length`` and ``micro_batch_size`` are accepted for a uniform signature and unused.
    """
    if len(model) != 1:
        raise ValueError("no-pipelining schedule runs exactly one model chunk")
    chunk, stats = model[0], []
    trace = trace or active_trace()
    run = trace.begin_run() if trace is not None else 0
    for i in range(num_microbatches):
        with _span(trace, 0, run, Step("F", 0, i)):
            loss = forward_step(forward_step_func, data_iterator, chunk, None, num_microbatches, True, stats)
        if not forward_only:
            with _span(trace, 0, run, Step("B", 0, i)):
                backward_step(None, loss, None)
    return stats


# ---------------------------------------------------------------- step orders
def one_f_one_b_steps(pp_size: int, pp_rank: int, num_microbatches: int, forward_only: bool = False) -> list[Step]:
    """The 1F1B order of rank ``pp_rank``: warmup forwards, steady one-forward-one-backward, cooldown."""
    m = num_microbatches
    if forward_only:
        return [Step("F", 0, i) for i in range(m)]
    warmup = min(pp_size - pp_rank - 1, m)
    steps = [Step("F", 0, i) for i in range(warmup)]
    for i in range(m - warmup):
        steps += [Step("F", 0, warmup + i), Step("B", 0, i)]
    steps += [Step("B", 0, i) for i in range(m - warmup, m)]
    return steps


def interleaved_steps(pp_size: int, pp_rank: int, num_microbatches: int, vp_size: int,
                      forward_only: bool = False) -> list[Step]:
    """The interleaved 1F1B order of rank ``pp_rank`` over ``vp_size`` chunks (Megatron's order).

    The k-th forward runs chunk ``(k mod pp*vp) // pp`` on micro batch ``(k // (pp*vp)) * pp + k mod pp``:
    groups of ``pp`` micro batches visit chunk 0, then chunk 1, ... The k-th backward visits the same
    micro batch in reverse chunk order. Rank r runs ``2 * (pp - r - 1) + (vp - 1) * pp`` warmup forwards.
    """
    pp, vp, total = pp_size, vp_size, num_microbatches * vp_size

    def forward_of(k: int) -> Step:
        group, position = divmod(k, pp * vp)
        return Step("F", position // pp, group * pp + position % pp)

    def backward_of(k: int) -> Step:
        _, chunk, microbatch = forward_of(k)
        return Step("B", vp - 1 - chunk, microbatch)

    if forward_only:
        return [forward_of(k) for k in range(total)]
    warmup = interleaved_warmup(pp, pp_rank, num_microbatches, vp)
    steps = [forward_of(k) for k in range(warmup)]
    for k in range(total - warmup):
        steps += [forward_of(warmup + k), backward_of(k)]
    steps += [backward_of(k) for k in range(total - warmup, total)]
    return steps


def check_pipeline_schedule(pp_size: int, vp_size: int, num_microbatches: int) -> None:
    """Raise ConfigError (one line) when no schedule can run this layout."""
    if num_microbatches < 1:
        raise ConfigError(f"a global batch needs at least one micro batch, got {num_microbatches}")
    if vp_size > 1 and pp_size == 1:
        raise ConfigError("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1")
    if vp_size > 1 and num_microbatches % pp_size != 0:
        raise ConfigError(
            f"the interleaved schedule needs the number of micro batches ({num_microbatches} = "
            f"--global-batch-size / (--micro-batch-size * dp)) to be a multiple of "
            f"--pipeline-model-parallel-size {pp_size}"
        )


# ---------------------------------------------------------------- the executor
def run_pipeline_steps(
    steps: Sequence[Step],
    forward_step_func: ForwardStepFunc,
    data_iterators: Sequence[Iterator | None],
    model: list[nn.Module],
    num_microbatches: int,
    p2p: PipelineP2P,
    forward_only: bool = False,
    trace: ScheduleTrace | None = None,
    v_shape: bool = False,
    posts: Sequence[Post] | None = None,
) -> list[LossStats]:
    """Run this rank's ``steps`` in order, exchanging activations and gradients with its neighbours as
    ``posts`` says (by default :func:`communication_plan`'s; chunks placed on the ring, or on the V with
    ``v_shape``).

    Inputs and outputs of a (chunk, micro batch) are kept from its forward to its backward and
    dropped right after, so the memory held is that of the micro batches in flight. Where the order has
    W steps, the forwards build split ops and each B step leaves its weight gradients to the W step of the
    same (chunk, micro batch) (``tensor_parallel/weight_grad.py``); every parameter's ``.grad`` (and the
    data-parallel reduction behind it) is then written by W steps only. A traced step spans
    its compute and the batch of p2p operations issued after it (recorded apart as ``comm``), so the
    trace's gaps are the time a rank waited for a neighbour.
    """
    ps, vp = model[0].ps, len(model)
    placement = ChunkPlacement(ps.pp_size, vp, v_shape)
    run = trace.begin_run() if trace is not None else 0
    split = any(step.kind == "W" for step in steps)
    if split:
        check_weight_steps(steps)
    params = [[p for p in chunk.parameters() if p.requires_grad] for chunk in model] if split else []
    awaiting_w: dict[tuple[int, int], weight_grad.WeightGradWork] = {}  # (chunk, micro batch) -> its W work
    if posts is None:
        posts = communication_plan(steps, ps.pp_size, ps.pp_rank, vp, v_shape)
    plan = {post.after: post for post in posts}
    sent = {i for post in plan.values() for i in post.sends}
    results: dict[int, torch.Tensor] = {}  # step index -> its result, until the batch that sends it
    receiving: dict[int, Received] = {}  # step index -> its posted input
    handed: dict[Step, torch.Tensor] = {}  # the V's tip: a step -> its input from this rank's other chunk

    def issue(post: Post) -> None:
        """Send the results of ``post.sends`` and post the receives of ``post.receives``, as one batch."""
        sends = []
        for i in post.sends:
            link = placement.result_link(ps.pp_rank, steps[i].kind, steps[i].chunk)
            sends.append((results.pop(i), link.peer, link.tag))
        receives = [placement.input_link(ps.pp_rank, steps[i].kind, steps[i].chunk)[:2] for i in post.receives]
        receiving.update(zip(post.receives, p2p.post(sends, receives)))

    def hand_over(step: Step, result: torch.Tensor) -> None:
        """Keep ``result`` for this rank's other chunk if the next (previous) stage is there."""
        link = placement.result_link(ps.pp_rank, step.kind, step.chunk)
        if link is not None and link.peer == 0 and not (forward_only and step.kind != "F"):
            handed[Step(step.kind, link.chunk, step.microbatch)] = result.detach() if step.kind == "F" else result

    inputs: dict[tuple[int, int], torch.Tensor | None] = {}
    outputs: dict[tuple[int, int], torch.Tensor] = {}
    stats: list[LossStats] = []
    if -1 in plan:
        issue(plan[-1])
    split_run = weight_grad.split_backward(ps.keep_gathered_sequence_for_wgrad) if split else contextlib.nullcontext()
    with split_run:
        for i, step in enumerate(steps):
            waited_since = time.perf_counter() if trace is not None and i in receiving else None
            received = receiving.pop(i).wait() if i in receiving else handed.pop(step, None)
            key = (step.chunk, step.microbatch)
            with _span(trace, ps.pp_rank, run, step, waited_since) as timing:
                result = None
                if step.kind == "F":
                    if received is not None and not forward_only:
                        received.requires_grad_()
                    output = forward_step(forward_step_func, data_iterators[step.chunk], model[step.chunk],
                                          received, num_microbatches, placement.is_last(ps.pp_rank, step.chunk),
                                          stats)
                    if not forward_only:
                        inputs[key], outputs[key] = received, output
                    result = output
                elif step.kind == "B" and split:
                    with weight_grad.deferring_weight_grads(params[step.chunk]) as work:
                        result = backward_step(inputs.pop(key), outputs.pop(key), received)
                    awaiting_w[key] = work
                elif step.kind == "B":
                    result = backward_step(inputs.pop(key), outputs.pop(key), received)
                else:
                    awaiting_w.pop(key).run()
                if result is not None:
                    hand_over(step, result)
                if i in sent:
                    results[i] = result
                if i in plan:
                    timing.handoff = time.perf_counter()
                    issue(plan[i])
    p2p.wait_for_sends()
    return stats


def _pipeline_p2p(model: list[nn.Module], seq_length: int | None, micro_batch_size: int | None) -> PipelineP2P:
    """The p2p channel of this rank, its tensor shape taken from the configuration (no shape exchange)."""
    chunk = model[0]
    if micro_batch_size is None:
        raise ValueError("pipelined schedules need micro_batch_size (the p2p tensor shape is [s, b, h])")
    # A context-parallel rank holds s / cp of each sequence (model/context_parallel/layout.py).
    local_seq_length = (seq_length or chunk.config.seq_length) // chunk.ps.cp_size
    shape = pipeline_tensor_shape(local_seq_length, micro_batch_size, chunk.config.hidden_size,
                                  chunk.ps.tp_size, getattr(chunk, "sequence_parallel", False))
    dtype = next((p.dtype for p in chunk.parameters() if p.is_floating_point()), torch.float32)
    return PipelineP2P(chunk.ps, shape, dtype)


def _chunk_data_iterators(data_iterator: Iterator | list[Iterator | None] | None, vp: int) -> list[Iterator | None]:
    """One iterator per chunk. Every chunk reads every micro batch in order, so one shared iterator is
    split with ``itertools.tee`` (it buffers only the micro batches the chunks are apart)."""
    if isinstance(data_iterator, list):
        if len(data_iterator) != vp:
            raise ValueError(f"got {len(data_iterator)} data iterators for {vp} model chunks")
        return data_iterator
    if vp == 1 or data_iterator is None:
        return [data_iterator] * vp
    return list(itertools.tee(data_iterator, vp))


def _run_one_chunk_order(order: Callable[..., list[Step]], forward_step_func: ForwardStepFunc,
                         data_iterator: Iterator[Any] | None, model: list[nn.Module], num_microbatches: int,
                         forward_only: bool, seq_length: int | None, micro_batch_size: int | None,
                         trace: ScheduleTrace | None) -> list[LossStats]:
    """Run ``order(pp_size, pp_rank, num_microbatches, forward_only)`` on this rank's one model chunk."""
    if len(model) != 1:
        raise ValueError(f"this schedule runs one model chunk per rank, got {len(model)}")
    ps = model[0].ps
    check_pipeline_schedule(ps.pp_size, 1, num_microbatches)
    steps = order(ps.pp_size, ps.pp_rank, num_microbatches, forward_only)
    return run_pipeline_steps(steps, forward_step_func, [data_iterator], model, num_microbatches,
                              _pipeline_p2p(model, seq_length, micro_batch_size), forward_only,
                              trace or active_trace())


def forward_backward_pipelining_without_interleaving(
    forward_step_func: ForwardStepFunc,
    data_iterator: Iterator[Any] | None,
    model: list[nn.Module],
    num_microbatches: int,
    forward_only: bool = False,
    *,
    seq_length: int | None = None,
    micro_batch_size: int | None = None,
    trace: ScheduleTrace | None = None,
) -> list[LossStats]:
    """1F1B over the pipeline stages, one model chunk per rank (see the module docstring)."""
    return _run_one_chunk_order(one_f_one_b_steps, forward_step_func, data_iterator, model, num_microbatches,
                                forward_only, seq_length, micro_batch_size, trace)


def forward_backward_pipelining_zero_bubble(
    forward_step_func: ForwardStepFunc,
    data_iterator: Iterator[Any] | None,
    model: list[nn.Module],
    num_microbatches: int,
    forward_only: bool = False,
    *,
    seq_length: int | None = None,
    micro_batch_size: int | None = None,
    trace: ScheduleTrace | None = None,
) -> list[LossStats]:
    """ZB-H1 over the pipeline stages, one model chunk per rank: 1F1B with split backwards (``zero_bubble.py``)."""
    return _run_one_chunk_order(zb_h1_steps, forward_step_func, data_iterator, model, num_microbatches,
                                forward_only, seq_length, micro_batch_size, trace)


def _run_v_order(order: Callable[..., list[Step]], forward_step_func: ForwardStepFunc,
                 data_iterator: Iterator[Any] | list[Iterator[Any] | None] | None, model: list[nn.Module],
                 num_microbatches: int, forward_only: bool, seq_length: int | None, micro_batch_size: int | None,
                 trace: ScheduleTrace | None) -> list[LossStats]:
    """Run ``order(pp_size, pp_rank, num_microbatches, forward_only)`` on this rank's two chunks placed in a V."""
    if len(model) != 2:
        raise ValueError(f"the V schedules run two model chunks per rank, got {len(model)}")
    ps = model[0].ps
    check_pipeline_schedule(ps.pp_size, 1, num_microbatches)
    orders, plans = _v_orders_and_plans(order, ps.pp_size, num_microbatches, forward_only)
    return run_pipeline_steps(orders[ps.pp_rank], forward_step_func, _chunk_data_iterators(data_iterator, 2), model,
                              num_microbatches, _pipeline_p2p(model, seq_length, micro_batch_size), forward_only,
                              trace or active_trace(), v_shape=True, posts=plans[ps.pp_rank])


@functools.cache
def _v_orders_and_plans(order: Callable[..., list[Step]], pp_size: int, num_microbatches: int,
                        forward_only: bool) -> tuple[list[list[Step]], list[list[Post]]]:
    """Every rank's order and in-order-safe plan (each rank computes all: its plan depends on its neighbours')."""
    orders = [order(pp_size, rank, num_microbatches, forward_only) for rank in range(pp_size)]
    return orders, in_order_plans(orders, pp_size, 2, v_shape=True)


def forward_backward_pipelining_zb_v(
    forward_step_func: ForwardStepFunc,
    data_iterator: Iterator[Any] | list[Iterator[Any] | None] | None,
    model: list[nn.Module],
    num_microbatches: int,
    forward_only: bool = False,
    *,
    seq_length: int | None = None,
    micro_batch_size: int | None = None,
    trace: ScheduleTrace | None = None,
) -> list[LossStats]:
    """ZB-V over two chunks per rank in a V, backwards split into B and W (``v_schedules.py``)."""
    return _run_v_order(zb_v_steps, forward_step_func, data_iterator, model, num_microbatches, forward_only,
                        seq_length, micro_batch_size, trace)


def forward_backward_pipelining_dualpipev(
    forward_step_func: ForwardStepFunc,
    data_iterator: Iterator[Any] | list[Iterator[Any] | None] | None,
    model: list[nn.Module],
    num_microbatches: int,
    forward_only: bool = False,
    *,
    seq_length: int | None = None,
    micro_batch_size: int | None = None,
    trace: ScheduleTrace | None = None,
) -> list[LossStats]:
    """DualPipeV over two chunks per rank in a V: forwards paired with other micro batches' backwards
    (``v_schedules.py``)."""
    return _run_v_order(dualpipev_steps, forward_step_func, data_iterator, model, num_microbatches, forward_only,
                        seq_length, micro_batch_size, trace)


def forward_backward_pipelining_with_interleaving(
    forward_step_func: ForwardStepFunc,
    data_iterator: Iterator[Any] | list[Iterator[Any] | None] | None,
    model: list[nn.Module],
    num_microbatches: int,
    forward_only: bool = False,
    *,
    seq_length: int | None = None,
    micro_batch_size: int | None = None,
    trace: ScheduleTrace | None = None,
) -> list[LossStats]:
    """Interleaved 1F1B over ``len(model)`` chunks per rank (see the module docstring).

    ``data_iterator`` is one iterator (split per chunk) or a list of one iterator per chunk.
    """
    ps = model[0].ps
    check_pipeline_schedule(ps.pp_size, len(model), num_microbatches)
    steps = interleaved_steps(ps.pp_size, ps.pp_rank, num_microbatches, len(model), forward_only)
    return run_pipeline_steps(steps, forward_step_func, _chunk_data_iterators(data_iterator, len(model)), model,
                              num_microbatches, _pipeline_p2p(model, seq_length, micro_batch_size), forward_only,
                              trace or active_trace())


def get_forward_backward_func(pp_size: int, vp_size: int = 1,
                              schedule: str | None = None) -> Callable[..., list[LossStats]]:
    """The schedule for this layout: no pipelining, 1F1B, interleaved 1F1B (the default by ``vp_size``), or
    the named ``--pipeline-schedule``."""
    check_pipeline_schedule_name(pp_size, vp_size, schedule)
    if pp_size == 1:
        return forward_backward_no_pipelining
    if schedule == "zb-h1":
        return forward_backward_pipelining_zero_bubble
    if schedule == "zb-v":
        return forward_backward_pipelining_zb_v
    if schedule == "dualpipev":
        return forward_backward_pipelining_dualpipev
    if vp_size > 1:
        return forward_backward_pipelining_with_interleaving
    return forward_backward_pipelining_without_interleaving


def _span(trace: ScheduleTrace | None, pp_rank: int, run: int, step: Step,
          waited_since: float | None = None) -> contextlib.AbstractContextManager[StepTiming]:
    return trace.span(pp_rank, run, step, waited_since) if trace is not None else contextlib.nullcontext(StepTiming())
