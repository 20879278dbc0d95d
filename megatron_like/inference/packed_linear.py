"""Inference only: tensor-parallel linears that multiply by a weight prepacked once (oneDNN or MKL).

``F.linear`` lets MKL re-lay out ("pack") the weight inside every call. For the handful of rows of a
decode step (one per sequence being generated) that repacking costs more than the multiply itself.
Two prepacked kernels exist in CPU builds of torch, the two ``torch.compile``'s freezing uses:

- oneDNN (``torch.ops.mkldnn._linear_pointwise`` on a weight reordered once), used for 2 rows and more.
  Measured on the 2-core AMD EPYC of docs/performance.md (1 thread, CPU time per call, 8 rows): the
  32000 x 512 output layer 6.5 ms vs 13.3 ms with ``F.linear`` and 10.0 ms with MKL's packed GEMM; the
  Llama layer's SwiGLU input 2816 x 512 0.25 ms vs 0.44 / 0.67 ms. The reordered weight serves any row
  count (the prefill too).
- MKL's packed GEMM (``torch.ops.mkl._mkl_linear``), used for 1 row, where it beats both (3.5 ms for
  the output layer vs 5.0 ms oneDNN, 6.4 ms ``F.linear``). A packed weight is made for one row count;
  other row counts fall back to the original weight inside the same kernel, so results are always right.

The choice depends only on the row count, never on a timing, so a run is reproducible.

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


def _has_mkl() -> bool:
    return bool(getattr(torch._C, "has_mkl", False)) and hasattr(torch.ops.mkl, "_mkl_linear")


def _has_onednn() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def backend(rows: int) -> str | None:
    """The prepacked kernel used for ``rows``-row matmuls: "onednn", "mkl", or None (neither in this build)."""
    preferred = ["mkl", "onednn"] if rows == 1 else ["onednn", "mkl"]
    return next((name for name in preferred if {"mkl": _has_mkl, "onednn": _has_onednn}[name]()), None)


def available() -> bool:
    """True when this torch build has a prepacked GEMM (CPU builds with oneDNN or MKL)."""
    return _has_onednn() or _has_mkl()


def _packed_matmul(module: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [..., in] @ W^T (+ bias)`` with the packed weight: ``[..., out]``."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    if module._packed_backend == "onednn":
        y = torch.ops.mkldnn._linear_pointwise(rows, module._packed_weight, bias, "none", [], "")
    else:
        y = torch.ops.mkl._mkl_linear(rows, module._packed_weight, module._packed_source, bias, module._packed_rows)
    return y.view(*x.shape[:-1], y.shape[-1])


def _pack(weight: torch.Tensor, rows: int, kind: str) -> torch.Tensor:
    if kind == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(weight, rows)
    return torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)


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
    nothing) without oneDNN and MKL.
    """
    kind = backend(rows)
    if kind is None:
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
            module._packed_weight = _pack(module._packed_source, rows, kind)
            module._packed_rows, module._packed_backend = rows, kind
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
                for name in ("_packed_weight", "_packed_param", "_packed_source", "_packed_rows", "_packed_backend",
                             "forward"):
                    module.__dict__.pop(name, None)
