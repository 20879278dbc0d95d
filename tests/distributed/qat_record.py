"""Record every fake-quant call of a QAT run, to compare a parallel layout with one process code by code.

A QAT forward's one discrete step is the rounding to int8 codes. A reduction order that differs between
layouts (the tp all-reduce of a row-parallel linear sums its halves in another order than one process
does) moves an activation by ~1e-7 relative; a value that sits that close to a rounding boundary
(``x / scale`` within ~1e-5 of ``k + 0.5``) lands on the other code, a change of one quantization step,
and the flip moves everything downstream. So two correct layouts agree on almost every code, not on all,
and their losses differ by what those flips are worth. The test therefore checks (see
``tests/distributed/test_vit_classification_qat_parallel.py``):

* exactness where it exists: each parallel quantizer call, replayed through a fresh single-process
  quantizer on the gathered full tensor (and its range state before the call), gives bitwise the same
  output: the scale really is the full row's / the full tensor's, whatever the layout;
* on the int8 grid: every output is ``code * scale`` with an integer code (the rounding really happens);
* a loss bound derived from the quantization step: the difference of the runs' losses is at most float
  noise plus ``sum |dL/dy| * |y_parallel - y_reference|`` over the quantized activations, the first-order
  effect of the codes that differ (one step ``scale`` each).

:class:`QuantizerRecorder` collects, per quantizer and call, the full (tp-gathered) input ``x`` and
output ``y``, the range before the call, and in a single-process run ``dL/dy`` (straight-through, so the
gradient of the reported loss, which averages the micro batches, with respect to the quantized input).
"""

from __future__ import annotations

import torch
from torch import nn

from megatron_like import collectives as comm
from megatron_like.parallel_state import ParallelState
from megatron_like.quantization import ActivationFakeQuant, WeightFakeQuant
from megatron_like.quantization.qat import quantizable_linears
from megatron_like.tensor_parallel import RowParallelLinear
from tests.distributed.gpt_runs import global_name

GRID_ATOL = 1e-3
"""|y / scale - round(y / scale)| allowed for an on-grid value (float32 division of ``code * scale``)."""


class QuantizerRecorder:
    """Forward hooks on every quantizer of the QAT linears of a chunk; ``records`` maps a key to its calls.

    Keys are ``layers.<global i>.<linear>.input`` / ``.weight``. Each call is a dict of full tensors:
    ``x``, ``y`` and, for inputs, ``amax`` / ``initialized`` before the call and ``rate``; ``grad`` (dL/dy)
    with ``grads=True`` (single process only: the hook would all-gather in backward).
    """

    def __init__(self, grads: bool = False) -> None:
        self.grads = grads
        self.records: dict[str, list[dict]] = {}

    def attach(self, chunk: nn.Module, ps: ParallelState) -> None:
        """Hook the quantizers of ``chunk`` (call right after the model provider built it)."""
        keep = ps.tp_rank == 0 and ps.dp_rank == 0  # tp ranks hold the same gathered tensors
        for name, linear in quantizable_linears(chunk).items():
            if not hasattr(linear, "input_quantizer"):
                continue  # a float linear (no --qat): nothing to record, which the test reports
            key = global_name(chunk, name)
            row = isinstance(linear, RowParallelLinear)
            input_dim = -1 if row else (0 if linear.sequence_parallel else None)
            linear.input_quantizer.register_forward_pre_hook(self._before_input)
            linear.input_quantizer.register_forward_hook(
                self._hook(f"{key}.input", ps, input_dim, keep, grads=self.grads))
            linear.weight_quantizer.register_forward_hook(
                self._hook(f"{key}.weight", ps, 1 if row else 0, keep, grads=False))

    @staticmethod
    def _before_input(module: ActivationFakeQuant, inputs: tuple) -> None:
        module._recorded_state = (module.amax.detach().clone(), module.initialized.detach().clone())

    def _hook(self, key: str, ps: ParallelState, dim: int | None, keep: bool, grads: bool):
        def gather(tensor: torch.Tensor) -> torch.Tensor:
            tensor = tensor.detach().float()
            return tensor.clone() if dim is None else comm.all_gather_along_dim(tensor, ps.tp_group, dim)

        def hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
            call = {"x": gather(inputs[0]), "y": gather(output)}
            if isinstance(module, ActivationFakeQuant):
                call["amax"], call["initialized"] = module._recorded_state
                call["rate"] = module.moving_rate
            if grads and output.requires_grad:
                output.register_hook(lambda grad: call.__setitem__("grad", gather(grad)))
            if keep:
                self.records.setdefault(key, []).append(call)

        return hook


def replay(key: str, call: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The single-process quantizer on the recorded full input: (output, scale broadcastable to it)."""
    if key.endswith(".weight"):
        quantizer = WeightFakeQuant()
        return quantizer(call["x"]), quantizer.scale(call["x"])
    quantizer = ActivationFakeQuant(float(call["rate"]))
    quantizer.amax.copy_(call["amax"])
    quantizer.initialized.copy_(call["initialized"])
    return quantizer(call["x"]), quantizer.scale()


def codes(key: str, call: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(float codes ``y / scale``, scale) of a recorded call, the scale as one process computes it."""
    _, scale = replay(key, call)
    return call["y"] / scale, scale


def merge_records(per_rank: list[dict[str, list[dict]]]) -> dict[str, list[dict]]:
    """The union over ranks (pipeline stages hold different layers; other ranks return nothing)."""
    merged: dict[str, list[dict]] = {}
    for records in per_rank:
        for key, calls in records.items():
            assert key not in merged, f"{key} recorded by two ranks"
            merged[key] = calls
    return merged
