"""Data parallelism and ZeRO over the data-parallel group, applied to this rank's model chunks.

``DataParallel(model, ps, zero_stage, overlap_grad_reduce)`` moves every parameter of every chunk into
the flat buffers of :mod:`megatron_like.distributed.buffers` (one :class:`ParamAndGradBuffer` per
chunk) and, at ZeRO-3, installs the gather/free hooks. The chunks stay plain modules (no wrapper: names,
``chunk.layers`` and ``set_input_tensor`` are unchanged); each gets a ``param_and_grad_buffer`` attribute.

One training step, as ``train_step`` drives it::

    data_parallel.start_grad_sync(num_microbatches)   # zero main grads, reset the hooks' counters
    schedule(...)                                     # backward hooks accumulate, reduce buckets
    data_parallel.finish_grad_sync()                  # remaining reductions, SP and tied-embedding sums
    optimizer.step()                                  # steps this rank's shards, all-gathers (stage 1/2)

ZeRO-3 gather and free points, per unit (a transformer layer, or a chunk's root: embeddings, final
LayerNorm, output layer):

* forward: gathered by a forward pre-hook, freed by the forward hook (not while a recompute runs
  inside backward: backward needs the params right after; nor the root when a backward will follow: its
  backward starts right after and holds it to the end, as FSDP2 keeps its root unsharded after forward);
* backward: gathered by a pre-hook on the ``grad_fn`` of the unit's output (it runs before any of the
  unit's backward ops), freed by the gradient hook once every param of the bucket has its gradient.

Prefetch (``--overlap-param-gather``): each of those pre-hooks first launches the asynchronous gather of
the unit that runs next (forward: root, layer 0, 1, ...; backward: root, layer L-1, L-2, ...), then waits for
its own, which the previous unit's hook launched. So one gather runs while a unit computes, and at most the
root and two layers are gathered at once (one computing, one arriving). At ZeRO-1/2 the same forward pre-hooks
finish the all-gather of the parameters the optimizer step updated, unit by unit, behind the next forward
(Megatron's ``--overlap-param-gather``); ``finish_param_sync`` completes them where params are read otherwise.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from megatron_like import collectives as comm
from megatron_like.distributed.buffers import Bucket, ParamAndGradBuffer
from megatron_like.parallel_state import ParallelState
from megatron_like.tensor_parallel.initialization import is_deferred
from megatron_like.tensor_parallel.random import is_recomputing


def _gather_unit(buckets: list[Bucket], prefetch: list[Bucket]) -> None:
    """Make ``buckets`` hold their full params; first launch the gather of ``prefetch`` (the unit used next),
    which then runs in the background while this unit computes."""
    for bucket in buckets:
        bucket.start_gather()
    for bucket in prefetch:
        bucket.start_gather()
    for bucket in buckets:
        bucket.wait_gather()


def _install_gather_hooks(buffer: ParamAndGradBuffer) -> None:
    """Gather each unit's params just before its forward (and at ZeRO-3 its backward), free them after
    (ZeRO-3), and with ``--overlap-param-gather`` launch the next unit's gather first (see module docstring)."""
    prefetch, zero3 = buffer.overlap_param_gather, buffer.zero_stage == 3

    def following(order: list[tuple[nn.Module, list[Bucket]]], index: int) -> list[Bucket]:
        return order[index + 1][1] if prefetch and index + 1 < len(order) else []

    backward_next = {id(module): following(buffer.backward_order, i) for i, (module, _) in
                     enumerate(buffer.backward_order)}
    for index, (module, buckets) in enumerate(buffer.forward_order):
        forward_next = following(buffer.forward_order, index)

        def before_forward(*_: object, buckets: list[Bucket] = buckets, forward_next: list[Bucket] = forward_next
                           ) -> None:
            # A recompute inside backward runs this unit's forward again; the next unit in forward order was
            # already used by then, so prefetching it would only waste a gather.
            _gather_unit(buckets, [] if is_recomputing() else forward_next)

        module.register_forward_pre_hook(before_forward)
        if not zero3:
            continue
        then = backward_next[id(module)]
        is_root = any(module is root for root, _ in buffer.root_units)

        def after_forward(_module: nn.Module, _args: object, output: object, buckets: list[Bucket] = buckets,
                          then: list[Bucket] = then, is_root: bool = is_root) -> None:
            backward_follows = isinstance(output, torch.Tensor) and output.grad_fn is not None
            if backward_follows:
                output.grad_fn.register_prehook(lambda grad_outputs: _gather_unit(buckets, then))
            # The root's backward is the next thing that runs (its output is the loss or the stage's output),
            # and its params stay gathered through the whole backward anyway: freeing them here only to gather
            # them again at once (the embedding's 4 x vocab x hidden bytes) would cost a gather and save no
            # peak. The gradient hook frees them when their gradients are complete, as for any unit.
            if not is_recomputing() and not (is_root and backward_follows):
                for bucket in buckets:
                    bucket.release()

        module.register_forward_hook(after_forward)


def _check_all_drawn(chunk: nn.Module) -> None:
    """Deferred parameters (ZeRO-3 start-up) are drawn by the buffers; one left on the meta device has no
    values (e.g. it does not require grad, so no bucket holds it): refuse instead of training without it."""
    left = [name for name, param in chunk.named_parameters() if is_deferred(param)]
    if left:
        raise ValueError(f"parameters {left} were built deferred (ZeRO-3) but hold no bucket, so they were never "
                         "drawn; make them trainable or create them outside deferred_init()")


class DataParallel:
    """Every model chunk's buffers: the training loop's handle on data parallelism and ZeRO."""

    def __init__(self, model: list[nn.Module], ps: ParallelState, zero_stage: int = 0,
                 overlap_grad_reduce: bool = False, overlap_param_gather: bool = False) -> None:
        self.ps, self.zero_stage = ps, zero_stage
        self.buffers = []
        for chunk in model:
            buffer = ParamAndGradBuffer(chunk, ps, zero_stage, overlap_grad_reduce,
                                        overlap_param_gather=overlap_param_gather and zero_stage >= 1)
            _check_all_drawn(chunk)
            chunk.param_and_grad_buffer = buffer
            if zero_stage == 3 or buffer.overlap_param_gather:
                _install_gather_hooks(buffer)
            self.buffers.append(buffer)

    def buckets(self) -> Iterator[Bucket]:
        for buffer in self.buffers:
            yield from buffer.buckets

    def start_grad_sync(self, num_microbatches: int) -> None:
        """Zero the main grads; the next ``num_microbatches`` backwards of each chunk make one step."""
        for buffer in self.buffers:
            buffer.start_grad_sync(num_microbatches)

    def finish_grad_sync(self) -> None:
        """Finish the data-parallel reduction, then sum the grads replicated across tp or stages.

        After the dp average each rank holds its shard of the averaged gradient. Then, on those shards
        (linear reductions commute, and the layouts line up, see buffers.py):

        1. sequence-parallel params (LayerNorms, row-parallel biases) hold partial gradients of their
           sequence shard: all-reduce (sum) over the tensor-parallel group;
        2. the tied word embedding on the first and last stage: all-reduce (sum) over the embedding group.
        """
        for buffer in self.buffers:
            buffer.finish_param_sync()  # no gather may still write a shard the optimizer is about to update
            buffer.finish_grad_sync()
        ps = self.ps
        if ps.tp_group is not None:
            slices = [s for buffer in self.buffers for s in buffer.sequence_parallel_grad_slices()]
            if slices:
                flat = torch.cat(slices)
                comm.all_reduce(flat, ps.tp_group)
                torch._foreach_copy_(slices, list(flat.split([s.numel() for s in slices])))
        tied = [grad for grad in (buffer.shared_embedding_grad() for buffer in self.buffers) if grad is not None]
        if len(tied) > 1:  # the V placement: this rank's first and last chunk each hold a copy
            torch.add(tied[0], tied[1], out=tied[0])
            tied[1].copy_(tied[0])
        elif tied and ps.embedding_group is not None:
            comm.all_reduce(tied[0], ps.embedding_group)

    def gather_updated_params(self) -> None:
        """After the optimizer wrote this rank's shards: make every rank's full params current (stage 1/2;
        with ``--overlap-param-gather`` during the next forward, see :meth:`finish_param_sync`)."""
        for buffer in self.buffers:
            buffer.gather_updated_params()

    def finish_param_sync(self) -> None:
        """Complete the gathers ``--overlap-param-gather`` left to the next forward (stage 1/2): call it before
        reading params outside a forward (a checkpoint, the end of a run)."""
        for buffer in self.buffers:
            buffer.finish_param_sync()


@contextlib.contextmanager
def gathered_parameters(model: list[nn.Module], write_back: bool = False) -> Iterator[None]:
    """Inside the block every parameter holds its full value, also at ZeRO-3 (a no-op otherwise).

    With ``write_back`` the (possibly modified, e.g. loaded from a checkpoint) full values are copied back
    into this rank's persistent shards on exit.
    """
    buffers = [chunk.param_and_grad_buffer for chunk in model if hasattr(chunk, "param_and_grad_buffer")]
    for buffer in buffers:
        buffer.finish_param_sync()  # stage 1/2 with --overlap-param-gather: updated params not all gathered yet
    buffers = [b for b in buffers if b.zero_stage == 3]
    for buffer in buffers:
        buffer.gather_all()
    try:
        yield
    finally:
        for buffer in buffers:
            buffer.release_all(write_back=write_back)
