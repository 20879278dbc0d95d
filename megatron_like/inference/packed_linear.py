"""Inference only: tensor-parallel linears that multiply by a weight prepacked once for MKL's GEMM.

``F.linear`` lets MKL re-lay out ("pack") the weight inside every call. For the handful of rows of a
decode step (one per sequence being generated) that repacking costs more than the multiply itself:
on our 2-core Xeon the 50k-vocabulary output layer took 17-38 ms for 8 rows with ``F.linear`` and
9-11 ms with the weight packed once (``torch.ops.mkl._mkl_linear``, the kernel ``torch.compile``'s
freezing uses for fp32 on CPU). A packed weight is made for one row count; other row counts (the
prefill, a last smaller batch) fall back to the original weight inside the same kernel, so results
are always right.

``pack_linears(model, rows)`` gives each ``ColumnParallelLinear``/``RowParallelLinear`` of the chunks a
packed copy of its weight (memory: one more copy of the weights) and an instance ``forward`` that uses
it under ``torch.no_grad``/``inference_mode`` in eval mode, and defers to the class's forward
otherwise. Only plain fp32 CPU linears without sequence parallelism or gathered outputs are packed;
``unpack_linears`` restores the model.
"""

from __future__ import annotations

import types
from collections.abc import Sequence

import torch
from torch import nn

from megatron_like.model.gpt import GPTModel
from megatron_like.tensor_parallel import ColumnParallelLinear, RowParallelLinear, reduce_from_tensor_parallel_region


def available() -> bool:
    """True when this torch build has MKL's packed GEMM ops (CPU builds with MKL)."""
    return bool(getattr(torch._C, "has_mkl", False)) and hasattr(torch.ops.mkl, "_mkl_linear")


def _packed_matmul(module: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [..., in] @ W^T (+ bias)`` with the packed weight: ``[..., out]``."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    y = torch.ops.mkl._mkl_linear(rows, module._packed_weight, module._packed_source, bias, module._packed_rows)
    return y.view(*x.shape[:-1], y.shape[-1])


def _column_forward(self: ColumnParallelLinear, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    if torch.is_grad_enabled() or self.training or (weight is not None and weight is not self._packed_param):
        return type(self).forward(self, x, weight)
    # copy_to_tensor_parallel_region is the identity in forward; no sequence parallelism, no gather.
    return _packed_matmul(self, x, None if self.skip_bias_add else self.bias)


def _row_forward(self: RowParallelLinear, x: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() or self.training:
        return type(self).forward(self, x)
    y = reduce_from_tensor_parallel_region(_packed_matmul(self, x, None), self.tp_group)
    return y if self.bias is None else y + self.bias


def _packable(weight: torch.Tensor | None) -> bool:
    return weight is not None and weight.dtype == torch.float32 and weight.device.type == "cpu"


def pack_linears(model: Sequence[GPTModel], rows: int) -> int:
    """Prepack the weights of every plain tp linear of ``model`` for ``rows``-row matmuls; return how many.

    ``rows``: the row count of a decode step (sequences generated together). Returns 0 (and changes
    nothing) without MKL.
    """
    if not available():
        return 0
    unpack_linears(model)
    count = 0
    for chunk in model:
        tied = chunk.embedding.word_embeddings.weight if chunk.pre_process else None
        for module in chunk.modules():
            if type(module) is ColumnParallelLinear and not module.sequence_parallel and not module.gather_output:
                source, forward = (module.weight if module.weight is not None else tied), _column_forward
            elif type(module) is RowParallelLinear and module.input_is_parallel and not module.sequence_parallel:
                source, forward = module.weight, _row_forward
            else:
                continue
            if not _packable(source):
                continue
            # Plain attributes (not registered parameters): the tied output layer is handed this tensor.
            module.__dict__["_packed_param"] = source
            module._packed_source = source.detach()
            module._packed_weight = torch.ops.mkl._mkl_reorder_linear_weight(module._packed_source, rows)
            module._packed_rows = rows
            module.forward = types.MethodType(forward, module)
            count += 1
        chunk.__dict__["_packed_rows"] = rows
    return count


def ensure_packed(model: Sequence[GPTModel], rows: int) -> None:
    """Pack for ``rows`` unless already packed for it (a server repacks when the batch size changes)."""
    if available() and any(chunk.__dict__.get("_packed_rows") != rows for chunk in model):
        pack_linears(model, rows)


def unpack_linears(model: Sequence[GPTModel]) -> None:
    """Drop the packed weights and restore the class forwards."""
    for chunk in model:
        chunk.__dict__.pop("_packed_rows", None)
        for module in chunk.modules():
            if "_packed_weight" in module.__dict__:
                for name in ("_packed_weight", "_packed_param", "_packed_source", "_packed_rows", "forward"):
                    module.__dict__.pop(name, None)
