"""Contiguous parameter and gradient buffers of one model chunk, reduced in buckets over data parallelism.

Units and buckets
-----------------
A chunk's parameters are grouped into *units*: one per transformer layer, plus the chunk's *root*
(embeddings, final LayerNorm, output layer). A unit is what ZeRO-3 gathers before its forward and
backward and frees after them. Each unit is one *bucket* (one flat range reduced together), except that
the tied word embedding gets a bucket of its own: its copies on the first and last pipeline stage then
sit at the same offsets of identically sized buckets, so the embedding-group all-reduce can run on a
ZeRO shard as well as on the full gradient. Buckets are laid out in backward order (last layer first),
the order in which their gradients complete.

Every bucket is padded to a multiple of the data-parallel size ``dp``; data-parallel rank ``r`` owns
elements ``[r * n / dp, (r + 1) * n / dp)`` of every bucket of ``n`` elements: its *shard*. Without ZeRO
(stage 0) a rank's "shard" is the whole bucket, which lets the optimizer treat all stages alike.

What each stage keeps (fp32 = ``main_grad``, p = the params' dtype)::

    stage           0                    1                    2                    3
    param_flat  p,  whole chunk          whole chunk          whole chunk          per bucket, only while
                                                                                   gathered
    param_shard     = param_flat         slice of param_flat  slice of param_flat  own storage (chunk-wide)
    grad_flat   fp32, whole chunk        whole chunk          per bucket, only     per bucket, only
                                                              during one backward  during one backward
    grad_shard      = grad_flat          slice of grad_flat   own storage, only from the step's first
                                                              reduction to the next step's start

Gradient flow
-------------
A post-accumulate-grad hook on each parameter adds ``param.grad`` (p) into its view of ``grad_flat``
(fp32, so micro batches accumulate in full precision) and drops ``param.grad``. When every parameter of
a bucket has reported for this micro batch the bucket is *complete*:

* stage 0/1: nothing happens before the last micro batch (no communication while accumulating). On the
  last one, with ``--overlap-grad-reduce`` the bucket's all-reduce (stage 0) or reduce-scatter (stage 1)
  is launched asynchronously right away, overlapping the rest of backward; without it every bucket is
  reduced in :meth:`ParamAndGradBuffer.finish_grad_sync`.
* stage 2/3: the bucket's gradient is reduce-scattered every micro batch (that is the price of not
  keeping a full gradient) into the persistent shard and its temporary ``grad_flat`` dropped. With
  ``--overlap-grad-reduce`` the reduce-scatter is asynchronous, and launching one first finishes the
  reductions launched before it (they overlapped the backward of this bucket): one is in flight at a
  time, so the transient full gradients are bounded by the chunk root's plus two layers' buckets (one
  accumulating, one in flight), whatever the number of micro batches. At stage 3 the gathered
  parameters are freed too.

Why not Megatron's way (accumulate full gradients over micro batches, reduce-scatter only in the last
one)? That keeps a full fp32 gradient (4 bytes per parameter) for the whole step, which is stage 1's
memory, and stage 1 already does exactly that.

Gradients are averaged over data-parallel ranks (scaled by ``1 / dp`` before the sum). With context parallelism
"data-parallel" here means the dp x cp ranks (``ps.dp_cp_group``): they hold the same parameters, and each cp
rank's loss comes scaled by cp so that the average over them is the gradient of the whole sequence's loss
(``model/context_parallel.py``).

Expert parameters (``param.expert_parallel``, docs/moe.md) get buckets of their own in each layer unit,
reduced, sharded (ZeRO) and gathered over the *expert-data-parallel* group (the ``dp / ep`` ranks holding
the same experts) instead of the data-parallel group. They are still scaled by ``1 / (dp cp)``: each expert's
gradient already sums the tokens of its ``ep`` expert-parallel ranks (the all-to-all's backward brings them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from megatron_like import collectives as comm
from megatron_like.parallel_state import ParallelState
from megatron_like.tensor_parallel import weight_grad
from megatron_like.tensor_parallel.initialization import is_deferred, materialize


def _ceil_to(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class Bucket:
    """Parameters reduced (and at ZeRO-3 gathered) together; views into the chunk's flat buffers.

    Attributes:
        params: the parameters, in layout order; ``ranges[i]`` is ``params[i]``'s ``(start, end)`` in the
            bucket's flat range.
        numel: flat length, padded to a multiple of ``dp``.
        shard_start, shard_numel: this rank's slice of the flat range (the whole range at stage 0).
    """

    def __init__(self, params: list[nn.Parameter], dp_size: int, dp_rank: int, sharded: bool,
                 is_shared_embedding: bool = False, group: comm.Group = None) -> None:
        self.params = params
        self.group = group  # the ranks this bucket is reduced, sharded and gathered over (dp_size of them)
        self.is_expert = any(getattr(p, "expert_parallel", False) for p in params)
        self.ranges: list[tuple[int, int]] = []
        offset = 0
        for param in params:
            self.ranges.append((offset, offset + param.numel()))
            offset += param.numel()
        self.numel = _ceil_to(max(offset, 1), dp_size)
        self.shard_numel = self.numel // dp_size if sharded else self.numel
        self.shard_start = dp_rank * self.shard_numel if sharded else 0
        self.is_shared_embedding = is_shared_embedding
        self.params_sharded = False  # ZeRO-3: param_flat is a temporary, gathered around each use
        # Views assigned by the owning ParamAndGradBuffer.
        self.param_flat: torch.Tensor  # [numel], params' dtype
        self.param_shard: torch.Tensor  # [shard_numel], params' dtype
        self.grad_flat: torch.Tensor | None = None  # [numel] fp32 (None between backwards at stage 2/3)
        self.grad_shard: torch.Tensor  # [shard_numel] fp32
        self.gathered = True  # param_flat holds storage (ZeRO-3 frees it between uses)
        self.params_stale = False  # ZeRO-1/2: the shard was updated, param_flat not yet re-gathered
        self._gather: object | None = None  # the all-gather writing into param_flat, in flight (work handle)
        # Per-step bookkeeping of the hooks.
        self.ready = 0
        self.micro_batches_done = 0
        self.reduction_launched = False

    def shard_segments(self) -> Iterator[tuple[nn.Parameter, int, int, int, int]]:
        """Yield ``(param, shard_lo, shard_hi, param_lo, param_hi)`` for each param overlapping this shard.

        ``shard_lo:shard_hi`` indexes ``grad_shard``/``param_shard``; ``param_lo:param_hi`` the flattened param.
        """
        lo_shard, hi_shard = self.shard_start, self.shard_start + self.shard_numel
        for param, (start, end) in zip(self.params, self.ranges):
            lo, hi = max(start, lo_shard), min(end, hi_shard)
            if lo < hi:
                yield param, lo - lo_shard, hi - lo_shard, lo - start, hi - start

    # ---------------------------------------------------------------- parameter all-gather
    def start_gather(self) -> None:
        """Launch the asynchronous all-gather of every rank's shard into ``param_flat``; :meth:`wait_gather`
        before reading the params. A no-op when ``param_flat`` is current or its gather is already in flight.

        ZeRO-3 first re-allocates ``param_flat``. ZeRO-1/2 (after the optimizer updated the shard) gather in
        place: the shard is this rank's chunk of ``param_flat``, which ``comm.all_gather_flat`` accepts as its
        input (no copy of the shard).
        """
        if self.params_sharded:
            if self.gathered:
                return
            self.param_flat.untyped_storage().resize_(self.numel * self.param_flat.element_size())
            self.gathered = True
        else:
            if not self.params_stale:
                return
            self.params_stale = False
        # The params are views of param_flat's storage, so they see the gathered values; writing through
        # param_flat (a different tensor) leaves the params' autograd version counters alone, so tensors
        # saved for backward before a ZeRO-3 free stay valid after the re-gather.
        self._gather = comm.all_gather_flat(self.param_flat, self.param_shard, self.group, async_op=True)

    def wait_gather(self) -> None:
        """Block until the gather launched by :meth:`start_gather` (if any) has filled ``param_flat``."""
        if self._gather is None:
            return
        work, self._gather = self._gather, None
        work.wait()

    def gather(self) -> None:
        """Make ``param_flat`` hold the full current values now (start the gather if needed, and wait)."""
        self.start_gather()
        self.wait_gather()

    def release(self) -> None:
        """ZeRO-3: free ``param_flat``'s storage; the params keep their shapes but hold no memory."""
        if self.gathered:
            self.wait_gather()  # a prefetched gather still writes into the storage
            self.param_flat.untyped_storage().resize_(0)
            self.gathered = False


def build_units(chunk: nn.Module) -> list[tuple[nn.Module, list[list[nn.Parameter]]]]:
    """``(module, [params of each bucket])`` per unit: the chunk's layers in backward order, then its root.

    The root (every parameter outside ``chunk.layers``) is split into the tied word embedding, if the
    chunk holds it, and the rest; a layer's expert parameters (MoE) are a bucket of their own, and so are the
    root's (the MoE layers of multi-token prediction depths).
    """
    layers = list(getattr(chunk, "layers", []))
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    units: list[tuple[nn.Module, list[list[nn.Parameter]]]] = []
    for layer in reversed(layers):
        params = [p for p in layer.parameters() if p.requires_grad]
        dense = [p for p in params if not getattr(p, "expert_parallel", False)]
        experts = [p for p in params if getattr(p, "expert_parallel", False)]
        if params:
            units.append((layer, [bucket for bucket in (dense, experts) if bucket]))
    shared = chunk.shared_embedding_weight() if hasattr(chunk, "shared_embedding_weight") else None
    root = [p for p in chunk.parameters() if p.requires_grad and id(p) not in in_layers and p is not shared]
    # The root holds the MTP depths' layers too (model/mtp.py): MoE ones bring experts, reduced over expert-dp.
    root_buckets = [bucket for bucket in (
        [p for p in root if not getattr(p, "expert_parallel", False)],
        [p for p in root if getattr(p, "expert_parallel", False)]) if bucket]
    if shared is not None and shared.requires_grad:
        root_buckets.append([shared])
    if root_buckets:
        units.append((chunk, root_buckets))
    return units


class ParamAndGradBuffer:
    """The flat buffers, buckets and gradient hooks of one model chunk (see the module docstring)."""

    def __init__(self, chunk: nn.Module, ps: ParallelState, zero_stage: int, overlap_grad_reduce: bool,
                 overlap_param_gather: bool = False) -> None:
        self.ps, self.zero_stage, self.overlap = ps, zero_stage, overlap_grad_reduce
        self.overlap_param_gather = overlap_param_gather
        # The ranks holding the same parameters: dp x cp (context-parallel ranks hold different tokens of one batch).
        self.dp_group, self.dp_size = ps.dp_cp_group, ps.dp_cp_size
        sharded = zero_stage >= 1
        dtypes = {p.dtype for p in chunk.parameters()}
        if len(dtypes) != 1:
            raise ValueError(f"a model chunk must hold one parameter dtype, found {sorted(map(str, dtypes))}")
        self.param_dtype = dtypes.pop()
        device = ps.device
        self.units: list[tuple[nn.Module, list[Bucket]]] = []
        self.buckets: list[Bucket] = []
        for module, bucket_params in build_units(chunk):
            shared = chunk.shared_embedding_weight() if hasattr(chunk, "shared_embedding_weight") else None
            unit_buckets = [self._bucket(params, ps, sharded, params[0] is shared) for params in bucket_params]
            self.units.append((module, unit_buckets))
            self.buckets += unit_buckets
        # The units in the order forward and backward use them: the root first in both (its hooks enclose the
        # whole chunk: it is gathered before any layer runs, and its backward starts before theirs).
        roots = [unit for unit in self.units if unit[0] is chunk]
        layers = [unit for unit in self.units if unit[0] is not chunk]  # backward order
        self.root_units = roots
        self.forward_order = roots + layers[::-1]
        self.backward_order = roots + layers
        total = sum(b.numel for b in self.buckets)
        total_shard = sum(b.shard_numel for b in self.buckets)
        # The persistent buffers; each bucket's tensors are views into them (or, at stage 3, own storage).
        self.param_data = (
            torch.zeros(total, dtype=self.param_dtype, device=device) if zero_stage < 3
            else torch.zeros(total_shard, dtype=self.param_dtype, device=device)
        )
        self.grad_data = (
            torch.zeros(total, dtype=torch.float32, device=device) if zero_stage < 2
            else torch.zeros(total_shard, dtype=torch.float32, device=device)
        )
        offset, shard_offset = 0, 0
        for bucket in self.buckets:
            n, s0, sn = bucket.numel, bucket.shard_start, bucket.shard_numel
            if zero_stage < 3:
                bucket.param_flat = self.param_data[offset : offset + n]
                bucket.param_shard = bucket.param_flat[s0 : s0 + sn]
            else:
                bucket.param_flat = torch.zeros(n, dtype=self.param_dtype, device=device)
                bucket.param_shard = self.param_data[shard_offset : shard_offset + sn]
            if zero_stage < 2:
                bucket.grad_flat = self.grad_data[offset : offset + n]
                bucket.grad_shard = bucket.grad_flat[s0 : s0 + sn]
            else:
                bucket.grad_shard = self.grad_data[shard_offset : shard_offset + sn]
            # Move each parameter into the flat buffer: from now on it is a view of param_flat. A deferred
            # parameter (ZeRO-3 start-up, built on the meta device) is drawn straight into its view: with the
            # release below, no more than this bucket of the unsharded chunk ever exists on this rank.
            for param, (start, end) in zip(bucket.params, bucket.ranges):
                view = bucket.param_flat[start:end].view(param.shape)
                if is_deferred(param):
                    materialize(param, view)
                else:
                    view.copy_(param.detach())
                    param.data = view
            if zero_stage == 3:
                bucket.param_shard.copy_(bucket.param_flat[s0 : s0 + sn])
                bucket.params_sharded = True
                bucket.release()
            offset, shard_offset = offset + n, shard_offset + sn
        self.grad_shards_allocated = True  # stage 2/3 free grad_data between steps (start_grad_sync)
        # (work handle, what to do once it completed, the input it reads: kept alive until then)
        self._pending: list[tuple[object, Callable[[], None], torch.Tensor]] = []
        self.num_microbatches = 1
        # Sequence-parallel params hold partial gradients summed over tp after the dp reduction; their
        # slices of this rank's shards (identical on every tp rank: same layout) are listed once here.
        self._sequence_parallel_slices = [
            (bucket, lo, hi) for bucket in self.buckets
            for param, lo, hi, _, _ in bucket.shard_segments() if getattr(param, "sequence_parallel", False)
        ]
        self._hook_handles = [
            param.register_post_accumulate_grad_hook(self._make_grad_hook(bucket, start, end))
            for bucket in self.buckets for param, (start, end) in zip(bucket.params, bucket.ranges)
        ]

    @staticmethod
    def _bucket(params: list[nn.Parameter], ps: ParallelState, sharded: bool, is_shared_embedding: bool) -> Bucket:
        """A bucket over the data-parallel (x context-parallel) group, or over the expert-data-parallel group for
        expert params."""
        if any(getattr(p, "expert_parallel", False) for p in params):
            return Bucket(params, ps.expert_dp_size, ps.expert_dp_rank, sharded, group=ps.expert_dp_group)
        return Bucket(params, ps.dp_cp_size, ps.dp_cp_rank, sharded, is_shared_embedding, group=ps.dp_cp_group)

    # ---------------------------------------------------------------- backward hooks
    def _make_grad_hook(self, bucket: Bucket, start: int, end: int) -> Callable[[nn.Parameter], None]:
        def hook(param: nn.Parameter) -> None:
            if weight_grad.is_deferring():
                return  # a zero-bubble B step: the gradient stays parked until its W step hands it over
            grad = param.grad
            if bucket.grad_flat is None and grad.numel() == bucket.numel and grad.dtype == torch.float32 \
                    and grad.is_contiguous() and grad.untyped_storage().nbytes() == 4 * grad.numel():
                # Stage 2/3, one fp32 param filling its bucket (the tied embedding, the largest): its fresh
                # gradient, owning its whole storage (it is freed after the reduction), becomes the bucket's
                # instead of a zeroed copy of it (4 x vocab x hidden bytes less at the end of backward).
                bucket.grad_flat = grad.detach().view(-1)
            else:
                if bucket.grad_flat is None:
                    bucket.grad_flat = torch.zeros(bucket.numel, dtype=torch.float32, device=param.device)
                bucket.grad_flat[start:end].add_(grad.reshape(-1))
            param.grad = None
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                self._bucket_complete(bucket)

        return hook

    def _bucket_complete(self, bucket: Bucket) -> None:
        """Every param of ``bucket`` has its gradient for this micro batch."""
        bucket.ready = 0
        bucket.micro_batches_done += 1
        if self.zero_stage == 3:
            bucket.release()
        if self.zero_stage >= 2:
            self._reduce(bucket, async_op=self.overlap)
        elif self.overlap and bucket.micro_batches_done == self.num_microbatches:
            self._reduce(bucket, async_op=True)

    def _reduce(self, bucket: Bucket, async_op: bool) -> None:
        """Average ``bucket.grad_flat`` over dp into ``bucket.grad_shard`` (launch; finish now or later)."""
        grad = bucket.grad_flat
        if self.dp_size > 1:
            grad.mul_(1.0 / self.dp_size)
        if self.zero_stage == 0:
            work = comm.all_reduce_flat(grad, bucket.group, async_op=async_op)

            def finish() -> None:
                pass
        else:
            # In place: the reduced shard lands in this rank's own chunk of the gradient (at stage 1 that chunk is
            # ``grad_shard`` itself), so the reduce-scatter needs no output of its own and nothing is copied after.
            own = grad[bucket.shard_start : bucket.shard_start + bucket.shard_numel]
            work = comm.reduce_scatter_flat(own, grad, bucket.group, async_op=async_op)
            if self.zero_stage == 1:
                def finish() -> None:
                    pass
            else:
                bucket.grad_flat = None  # `grad` lives on in _pending until the collective is waited for

                # The full gradient is freed here, on this thread, once the collective is done with it: the
                # backend's worker thread may otherwise drop the last reference later (the profiler and the
                # CPU log figure, which watch this thread, would then never see the free).
                def finish() -> None:
                    self._allocate_grad_shards()
                    bucket.grad_shard.add_(own)
                    grad.untyped_storage().resize_(0)
        bucket.reduction_launched = True
        if not async_op or work is None:
            finish()
            return
        # One reduction in flight: finish the earlier ones now (they had this bucket's backward to complete).
        # At stage 2/3 each holds a full fp32 bucket gradient, every micro batch; and on gloo the reduce-scatter
        # receives the other ranks' chunks, (dp - 1) / dp of its input (collectives.reduce_scatter_flat).
        # Unbounded, either would grow with the micro batches or buckets.
        self._finish_pending()
        self._pending.append((work, finish, grad))

    def _finish_pending(self) -> None:
        """Wait for every launched reduction, add its result into the shard, drop the full gradient it held."""
        for work, finish, _ in self._pending:
            work.wait()
            finish()
        self._pending.clear()

    # ---------------------------------------------------------------- per step
    def start_grad_sync(self, num_microbatches: int) -> None:
        """Zero the gradients and the hooks' counters before the first micro batch of a step.

        Stage 2/3 instead free the gradient shards: nothing reads them before the step's first reduction
        lands (:meth:`_allocate_grad_shards`), and the forward and the start of backward (the output layer's
        logits and their gradient, often the step's peak) then run without their ``4 x params / dp`` bytes,
        as FSDP2's gradients, set to None after each optimizer step, are absent there.
        """
        self.num_microbatches = num_microbatches
        if self.zero_stage >= 2:
            self._free_grad_shards()
        else:
            self.grad_data.zero_()
        for bucket in self.buckets:
            bucket.ready = bucket.micro_batches_done = 0
            bucket.reduction_launched = False
            if self.zero_stage >= 2:
                bucket.grad_flat = None

    def finish_grad_sync(self) -> None:
        """Reduce what the hooks have not, wait for every launched reduction; grads are then final."""
        for bucket in self.buckets:
            if self.zero_stage >= 2:
                if bucket.grad_flat is not None:  # a backward that did not reach every param of the bucket
                    bucket.ready = 0
                    self._reduce(bucket, async_op=True)
                if self.zero_stage == 3:
                    bucket.release()
            elif not bucket.reduction_launched:
                self._reduce(bucket, async_op=True)
        self._finish_pending()
        for bucket in self.buckets:
            if self.zero_stage >= 2:
                bucket.grad_flat = None
        self._allocate_grad_shards()  # zeros if no reduction landed (no bucket got a gradient this step)

    def _free_grad_shards(self) -> None:
        """Stage 2/3: give back ``grad_data``'s storage; its views (the buckets' ``grad_shard``, the optimizer's
        segments) keep their shapes and see the storage again once :meth:`_allocate_grad_shards` restores it."""
        self.grad_data.untyped_storage().resize_(0)
        self.grad_shards_allocated = False

    def _allocate_grad_shards(self) -> None:
        """Stage 2/3: restore ``grad_data``'s storage, zeroed, if :meth:`start_grad_sync` freed it."""
        if not self.grad_shards_allocated:
            self.grad_data.untyped_storage().resize_(self.grad_data.numel() * self.grad_data.element_size())
            self.grad_data.zero_()
            self.grad_shards_allocated = True

    def sequence_parallel_grad_slices(self) -> list[torch.Tensor]:
        """Views of this rank's reduced gradient that belong to sequence-parallel params."""
        return [bucket.grad_shard[lo:hi] for bucket, lo, hi in self._sequence_parallel_slices]

    def shared_embedding_grad(self) -> torch.Tensor | None:
        """This rank's reduced gradient of the tied word embedding (its own bucket), if the chunk holds it."""
        for bucket in self.buckets:
            if bucket.is_shared_embedding:
                return bucket.grad_shard
        return None

    # ---------------------------------------------------------------- after the optimizer step
    def gather_updated_params(self) -> None:
        """Stage 1/2: all-gather every rank's updated shard so each rank holds the whole model again.

        With ``--overlap-param-gather`` only the first unit's gather is launched here; each unit's forward
        pre-hook then waits for its own and launches the next one's (``data_parallel.py``), so the gathers
        run behind the next step's forward. Otherwise every bucket is gathered now.
        """
        if self.zero_stage not in (1, 2) or self.dp_size == 1:
            return
        for bucket in self.buckets:
            bucket.params_stale = True
        if self.overlap_param_gather and self.forward_order:
            for bucket in self.forward_order[0][1]:
                bucket.start_gather()
            return
        self.finish_param_sync()

    def finish_param_sync(self) -> None:
        """Stage 1/2: finish every pending gather of updated params (before params are read outside a forward:
        checkpoints, the end of a run, the next optimizer step), one in flight at a time."""
        if self.zero_stage not in (1, 2):
            return
        previous: Bucket | None = None
        for bucket in self.buckets:
            bucket.start_gather()
            if previous is not None:
                previous.wait_gather()
            previous = bucket
        if previous is not None:
            previous.wait_gather()

    def gather_all(self) -> None:
        """Stage 3: gather every bucket (checkpointing, tests); :meth:`release_all` frees them again."""
        for bucket in self.buckets:
            bucket.gather()

    def release_all(self, write_back: bool = False) -> None:
        """Stage 3: free every gathered bucket, first copying this rank's slice back when ``write_back``."""
        if self.zero_stage != 3:
            return
        for bucket in self.buckets:
            if write_back and bucket.gathered:
                s0 = bucket.shard_start
                bucket.param_shard.copy_(bucket.param_flat[s0 : s0 + bucket.shard_numel])
            bucket.release()
