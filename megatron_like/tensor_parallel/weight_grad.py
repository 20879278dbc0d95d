"""Split backward: input gradients now (B), weight gradients later (W), for the zero-bubble pipeline schedules.

A zero-bubble schedule (``pipeline_parallel/zero_bubble.py``) runs each micro batch's backward in two steps:

* **B** backpropagates to the chunk's input and sends that gradient on (the critical path of the pipeline);
* **W** computes the weight gradients, whenever the schedule has a gap to fill.

The heavy weight gradients (every GEMM: the tensor-parallel linears but the output layer, the MoE router, the
experts' grouped GEMM, and the word and position embeddings' scatter-add) are computed by ops whose
backward returns only the input gradient and hands the weight gradient to a closure that keeps just what it
needs: the op's input and its output gradient. Under sequence parallelism those are, by default, the sequence
shards (a column-parallel linear's input ``[s / tp, b, in]``, a row-parallel one's output gradient ``[s / tp, b,
h]``), all-gathered again in W (``sequence_parallel_linear.py``); ``split_backward(keep_gathered=True)``
(``--keep-gathered-sequence-for-wgrad``) keeps the gathered ``[s, b, .]`` tensors instead. The closures of one B
step are a :class:`WeightGradWork`; the schedule's W step runs it, in the order B queued them: the order in which
B ran the ops' input gradients, whose tensor-parallel collectives already need that order to be the same on every
tp rank of the stage, so the W step's all-gathers match across the tp ranks too. Every other parameter (norms,
the biases fused into kernels: reductions of ``O(s b h)``; the output layer, whose output gradient is too large
to keep) gets its gradient during B, *parked* off ``.grad`` in the same work and handed over in W. So every
parameter's gradient reaches ``.grad`` (and the data-parallel buffer's hook, ``distributed/buffers.py``, which
starts DP reductions and ZeRO) in W only, once per micro batch: a chunk's reduction starts after its last W.

Usage (what the executor does)::

    with split_backward():                       # around the whole schedule: forwards build split ops
        ... forward ...
        with deferring_weight_grads(params) as work:   # one B step
            torch.autograd.backward(output, grad)
        ... later ...
        work.run()                               # its W step: weight grads into .grad, once per parameter

Outside :func:`split_backward` nothing here is used: the other schedules run the plain ops.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from megatron_like.tensor_parallel import cpu_gemm

WeightGrads = list[tuple[torch.Tensor, torch.Tensor]]
"""(parameter, its gradient) pairs a closure returns."""

_split_depth = 0
_keep_gathered = False
_work: WeightGradWork | None = None


@dataclass
class WeightGradWork:
    """The W step of one (chunk, micro batch): closures that compute weight gradients, and parked gradients."""

    closures: list[Callable[[], WeightGrads]] = field(default_factory=list)
    parked: WeightGrads = field(default_factory=list)
    kept_bytes: int = 0
    """Bytes of the tensors the closures keep (each op's input and output gradient) from B until W."""
    done: bool = False

    def run(self) -> None:
        """Compute every deferred weight gradient and accumulate each parameter's sum into its ``.grad`` once
        (through autograd, so post-accumulate hooks run as after a plain backward)."""
        if self.done:
            raise RuntimeError("a W step ran twice for the same micro batch and chunk")
        self.done = True
        params, grads = self._sum_by_parameter()
        if params:
            with torch.enable_grad():
                torch.autograd.backward(_HandOver.apply(grads, *params))

    def _sum_by_parameter(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Run the closures; return the parameters and the sum of each one's gradients (parked ones included)."""
        totals: dict[int, list] = {}
        pairs, self.parked = self.parked, []
        while pairs or self.closures:
            for param, grad in pairs:
                if id(param) in totals:
                    totals[id(param)][1] = totals[id(param)][1] + grad
                else:
                    totals[id(param)] = [param, grad]
            # Dropping each closure once it ran frees what it kept (its op's input and output gradient). A
            # closure runs outside autograd's backward, so grad mode is turned off here as the backward would: no
            # graph is built on its inputs (which may require grad), and the collectives' outputs can be written.
            with torch.no_grad():
                pairs = self.closures.pop(0)() if self.closures else []
        return [param for param, _ in totals.values()], [grad for _, grad in totals.values()]


class _HandOver(torch.autograd.Function):
    """Forward: a scalar zero that depends on ``params``; backward: ``grads`` (popped from their list) as the
    params' gradients.

    Backpropagating this node hands each gradient to the parameter's ``AccumulateGrad`` as the only reference to
    it, so, as in a plain backward, a parameter without ``.grad`` takes the tensor itself and one with a ``.grad``
    adds it in place, and the post-accumulate hooks (the data-parallel buffer's) run once per parameter.
    ``torch.autograd.backward(params, grads)`` would clone each gradient instead (the caller's list still
    references it): a copy of every weight gradient and fresh pages for it on every W step.
    """

    @staticmethod
    def forward(ctx, grads: list[torch.Tensor], *params: torch.Tensor) -> torch.Tensor:
        ctx.grads = grads
        return params[0].new_zeros(())

    @staticmethod
    def backward(ctx, _unused: torch.Tensor):
        grads = tuple(ctx.grads)
        ctx.grads.clear()
        return (None, *grads)


def is_split() -> bool:
    """True inside :func:`split_backward`: forwards build ops whose weight gradient can wait."""
    return _split_depth > 0


def keeps_gathered() -> bool:
    """True inside ``split_backward(keep_gathered=True)``: sequence-parallel linears keep their all-gathered
    ``[s, b, .]`` tensors for W instead of the shards (``sequence_parallel_linear.py``)."""
    return _keep_gathered


def is_deferring() -> bool:
    """True during a B step: weight gradients go to its :class:`WeightGradWork`, not to ``.grad``."""
    return _work is not None


@contextlib.contextmanager
def split_backward(keep_gathered: bool = False) -> Iterator[None]:
    """Build split ops in the forwards inside the block (a zero-bubble schedule's whole run); ``keep_gathered``:
    see :func:`keeps_gathered`."""
    global _split_depth, _keep_gathered
    _split_depth += 1
    outer, _keep_gathered = _keep_gathered, keep_gathered
    try:
        yield
    finally:
        _split_depth -= 1
        _keep_gathered = outer


@contextlib.contextmanager
def deferring_weight_grads(params: Sequence[torch.Tensor]) -> Iterator[WeightGradWork]:
    """Run one B step inside the block; yield the W work it leaves.

    ``params`` are the chunk's parameters: whatever gradient the backward accumulates into their ``.grad``
    (the unsplit ones) is moved into the work, and ``.grad`` is left as it was before the block.
    """
    global _work
    if _work is not None:
        raise RuntimeError("B steps do not nest")
    before = [p.grad for p in params]
    for p in params:
        p.grad = None
    work = _work = WeightGradWork()
    try:
        yield work
    finally:
        _work = None
        for p, grad in zip(params, before):
            if p.grad is not None:
                work.parked.append((p, p.grad))
            p.grad = grad


def defer(closure: Callable[[], WeightGrads], kept: Sequence[torch.Tensor] = ()) -> bool:
    """Queue ``closure`` (it returns (parameter, gradient) pairs) in the running B step's work, keeping the
    tensors ``kept`` (counted in ``kept_bytes``); False when no B step is deferring (the caller then computes the
    weight gradient at once)."""
    if _work is None:
        return False
    _work.closures.append(closure)
    _work.kept_bytes += sum(t.numel() * t.element_size() for t in kept)
    return True


def _is_trainable_leaf(t: torch.Tensor | None) -> bool:
    return t is not None and t.requires_grad and t.is_leaf


class _SplitGemm(torch.autograd.Function):
    """``y = op.forward(x, weight, bias)``; backward returns ``dx`` now and defers ``(dweight, dbias)``.

    ``op`` gives three functions: ``forward(x, w, b, extra)``, ``input_grad(dy, w, extra)`` and
    ``weight_grad(dy, x, extra, with_bias) -> (dw, db)``. Only ``x`` and ``dy`` are kept for W (and ``weight``
    itself for the input gradient, until B).
    """

    @staticmethod
    def forward(ctx, op, extra, x, weight, bias):
        ctx.op, ctx.extra, ctx.weight, ctx.bias = op, extra, weight, bias
        ctx.save_for_backward(x, weight)
        return op.forward(x, weight, bias, extra)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        op, extra, bias = ctx.op, ctx.extra, ctx.bias
        dx = op.input_grad(dy, weight, extra) if ctx.needs_input_grad[2] else None
        wanted = (ctx.needs_input_grad[3], bias is not None and ctx.needs_input_grad[4])

        def weight_grads() -> WeightGrads:
            dw, db = op.weight_grad(dy, x, extra, wanted[1])
            return [(p, g) for p, g, want in ((ctx.weight, dw, wanted[0]), (bias, db, wanted[1])) if want]

        # Only leaves can take their gradient later: a weight computed in the forward (a cast, a fake
        # quantization) has its own graph, which this backward is about to free.
        leaves = all(_is_trainable_leaf(p) for p, want in ((ctx.weight, wanted[0]), (bias, wanted[1])) if want)
        if leaves and defer(weight_grads, kept=(x, dy)):
            return None, None, dx, None, None
        dw, db = op.weight_grad(dy, x, extra, wanted[1])
        return None, None, dx, dw if wanted[0] else None, db if wanted[1] else None


class _LinearOp:
    """``x [..., in] @ weight[out, in]^T + bias``, the GEMMs of ``cpu_gemm`` (``extra``: its backend)."""

    @staticmethod
    def forward(x, weight, bias, backend):
        return cpu_gemm.linear(x, weight, bias, backend)

    @staticmethod
    def input_grad(dy, weight, backend):
        return cpu_gemm.linear(dy, weight.t(), None, backend)

    @staticmethod
    def weight_grad(dy, x, backend, with_bias):
        return linear_weight_grads(dy, x, with_bias)


def linear_weight_grads(dy: torch.Tensor, x: torch.Tensor,
                        with_bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``dW = dy^T x [out, in]`` and ``db = sum(dy) [out]`` (None unless ``with_bias``) of a linear with input ``x
    [..., in]`` and output gradient ``dy [..., out]``."""
    dy2d = dy.reshape(-1, dy.shape[-1])
    return dy2d.t().mm(x.reshape(-1, x.shape[-1])), dy2d.sum(0) if with_bias else None


class _EmbeddingOp:
    """Row lookup ``weight[ids]`` (``ids`` int ``[b, s]``, ``x`` here); no input gradient."""

    @staticmethod
    def forward(ids, weight, bias, num_rows):
        return F.embedding(ids, weight)

    @staticmethod
    def input_grad(dy, weight, num_rows):
        return None

    @staticmethod
    def weight_grad(dy, ids, num_rows, with_bias):
        dw = dy.new_zeros(num_rows, dy.shape[-1])
        return dw.index_add_(0, ids.reshape(-1), dy.reshape(-1, dy.shape[-1])), None


class _GroupedOp:
    """Rows of ``x [T, k]`` in expert blocks times ``weight[e] [k, n]`` (``extra``: (counts, matmul function))."""

    @staticmethod
    def forward(x, weight, bias, extra):
        counts, matmul = extra
        return matmul(x, weight, counts)

    @staticmethod
    def input_grad(dy, weight, extra):
        counts, matmul = extra
        return matmul(dy, weight.transpose(1, 2), counts)

    @staticmethod
    def weight_grad(dy, x, extra, with_bias):
        counts, _ = extra
        sizes = counts.tolist()
        dw = torch.stack([xs.t().mm(ds) for xs, ds in zip(x.split(sizes), dy.split(sizes))])
        return dw, None


def splits(weight: torch.Tensor, defer: bool = True) -> bool:
    """True when an op on ``weight`` built now is to be split (inside :func:`split_backward`, with autograd on and
    ``weight`` trainable; ``defer`` False: the caller wants its weight gradient during B)."""
    return defer and is_split() and torch.is_grad_enabled() and weight.requires_grad


def split_op(op, extra, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``op.forward(x, weight, bias, extra)`` as a split op: its backward returns the input gradient and defers
    the weight (and bias) gradient to the W step, keeping ``x`` and the output gradient (``_SplitGemm``)."""
    return _SplitGemm.apply(op, extra, x, weight, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, backend: str,
           defer: bool = True) -> torch.Tensor:
    """``x [..., in] @ weight[out, in]^T + bias`` -> ``[..., out]``; inside :func:`split_backward` its weight
    gradient waits for the W step (unless ``defer`` is False)."""
    if not splits(weight, defer):
        return cpu_gemm.linear(x, weight, bias, backend)
    return split_op(_LinearOp, backend, x, weight, bias)


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``weight[ids]``: ids ``[b, s]``, weight ``[v, h]`` -> ``[b, s, h]``; split as :func:`linear`."""
    if not splits(weight):
        return F.embedding(ids, weight)
    return split_op(_EmbeddingOp, weight.shape[0], ids, weight, None)


def grouped_matmul(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor,
                   matmul: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``matmul(x [T, k], weight [E, k, n], counts [E])`` -> ``[T, n]`` (the experts' GEMM); split as :func:`linear`."""
    if not splits(weight):
        return matmul(x, weight, counts)
    return split_op(_GroupedOp, (counts, matmul), x, weight, None)
