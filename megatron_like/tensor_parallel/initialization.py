"""Creating parameters and drawing their initial values: now, or later unit by unit (ZeRO-3 start-up).

Layout-independent values
-------------------------
Every random weight holds the values of the single-process model: the *full* (unsplit) weight is drawn
in fp32 from its own generator ``init_generator(seed, name)`` and each rank keeps its tensor-parallel
slice (``full.chunk(tp, partition_dim)[tp_rank]``), cast to the parameter's dtype. So any tp/pp/dp layout
starts from exact slices of the same model.

:func:`draw_slice` produces those bits without ever holding the full weight: it draws the weight in
chunks of rows (about :data:`DRAW_CHUNK_ELEMENTS` fp32 values at once) and copies the part of each
chunk this rank keeps. Chunks give the same bits as one draw because of how PyTorch's CPU ``normal_``
consumes its generator (checked for awkward shapes in ``tests/unit/test_initialization.py``): for a
contiguous float tensor of at least 16 elements it takes one uniform number per element in order, then
turns each aligned block of 16 into normals (Box-Muller on pairs 8 apart), and, when the size is not a
multiple of 16, redraws the last 16 from the next 16 uniforms. Chunks whose sizes are multiples of 16,
the last one at least 16 long, therefore read the same uniforms and form the same blocks.

Deferred parameters (ZeRO-3)
----------------------------
Inside :func:`deferred_init` a parameter made by :func:`new_parameter` lives on the meta device (its
shape, no memory) and keeps its ``fill`` (the function that writes its values). ``DataParallel`` then
builds the chunk's buffers unit by unit (a unit: a transformer layer, or the embeddings and head): it
allocates the unit's flat gather buffer, :func:`materialize` draws each parameter straight into its view
of it, this rank keeps its ZeRO-3 shard and the buffer is freed before the next unit. No rank ever holds
more than its shard plus one unit, where building the stage first would hold the whole stage (70B
parameters at dp 64 without tp/pp: 280 GB in fp32 per rank, before any sharding). The values are the
ones drawn eagerly: the same ``fill`` runs, only later.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

InitMethod = Callable[[torch.Tensor, torch.Generator], None]
"""Writes random values into an fp32 tensor from a generator (e.g. :func:`normal_init`)."""
Fill = Callable[[torch.Tensor], None]
"""Writes a parameter's initial values into a tensor of the parameter's shape, dtype and device."""

DRAW_CHUNK_ELEMENTS = 1 << 22
"""fp32 values of a full weight held at once while drawing it (16 MiB; GPT-3 175B's fc1 is 604 M)."""
_NORMAL_BLOCK = 16
"""PyTorch's CPU normal_ works on blocks of 16 values (see the module docstring)."""


def normal_init(std: float) -> InitMethod:
    """Weights ~ N(0, std^2), drawn from the given generator."""

    def init(tensor: torch.Tensor, generator: torch.Generator) -> None:
        torch.nn.init.normal_(tensor, mean=0.0, std=std, generator=generator)

    # normal_ consumes its generator element by element (module docstring), so draw_slice may draw a
    # weight in chunks of rows. An init method without this tag is drawn whole.
    init.draws_in_row_chunks = True
    return init


def xavier_uniform_init() -> InitMethod:
    """Weights ~ U(-a, a), a = sqrt(6 / (fan_in + fan_out)) of the full weight, drawn whole from the generator."""

    def init(tensor: torch.Tensor, generator: torch.Generator) -> None:
        torch.nn.init.xavier_uniform_(tensor, generator=generator)

    return init


# ------------------------------------------------------------------------------ layout-independent draws
def rows_per_chunk(row_elements: int, chunk_elements: int) -> int:
    """Rows of ``row_elements`` values per chunk: about ``chunk_elements`` values, a multiple of 16."""
    rows = max(1, chunk_elements // row_elements)
    while (rows * row_elements) % _NORMAL_BLOCK:
        rows += 1
    return rows


def draw_slice(out: torch.Tensor, init_method: InitMethod, generator: torch.Generator, full_shape: tuple[int, ...],
               partition_dim: int | None = None, tp_rank: int = 0, tp_size: int = 1,
               chunk_elements: int | None = None) -> None:
    """Write this rank's slice of the full fp32 weight ``init_method`` draws into ``out``, chunk by chunk.

    Bit-identical to ``full = torch.empty(full_shape); init_method(full, generator);
    out.copy_(full.chunk(tp_size, partition_dim)[tp_rank])`` (the whole weight when ``partition_dim`` is
    None), but with at most ``chunk_elements`` (default :data:`DRAW_CHUNK_ELEMENTS`) values of ``full`` alive
    (plus 15 rows) when the init method allows it (``normal_init``). ``out`` has the slice's shape, any dtype
    and device (values are cast).
    """
    if not getattr(init_method, "draws_in_row_chunks", False) or len(full_shape) not in (1, 2):
        full = torch.empty(full_shape, dtype=torch.float32)
        init_method(full, generator)
        out.copy_(full if partition_dim is None else full.chunk(tp_size, dim=partition_dim)[tp_rank])
        return
    rows = full_shape[0]
    cols = full_shape[1] if len(full_shape) == 2 else 1
    if rows * cols == 0:
        return
    row_lo, row_hi, col_lo, col_hi = 0, rows, 0, cols
    if partition_dim == 0:
        row_lo, row_hi = tp_rank * rows // tp_size, (tp_rank + 1) * rows // tp_size
    elif partition_dim == 1:
        col_lo, col_hi = tp_rank * cols // tp_size, (tp_rank + 1) * cols // tp_size
    out_2d = out.view(row_hi - row_lo, col_hi - col_lo)
    step = rows_per_chunk(cols, chunk_elements or DRAW_CHUNK_ELEMENTS)
    start = 0
    while start < rows:
        end = min(rows, start + step)
        if (rows - end) * cols < _NORMAL_BLOCK:
            end = rows  # a remainder under 16 values would take PyTorch's one-by-one path: draw it with this chunk
        chunk = torch.empty(end - start, cols, dtype=torch.float32)
        init_method(chunk, generator)  # rows [start, end) of the full weight, in the order one draw makes them
        lo, hi = max(start, row_lo), min(end, row_hi)
        if lo < hi:
            out_2d[lo - row_lo : hi - row_lo].copy_(chunk[lo - start : hi - start, col_lo:col_hi])
        del chunk  # before the next one is allocated: one chunk alive at a time
        start = end


# ------------------------------------------------------------------------------ parameters, now or deferred
class _Deferral:
    enabled = False


@contextlib.contextmanager
def deferred_init(enabled: bool = True) -> Iterator[None]:
    """Parameters made by :func:`new_parameter` inside the block hold no memory until :func:`materialize`."""
    previous = _Deferral.enabled
    _Deferral.enabled = enabled
    try:
        yield
    finally:
        _Deferral.enabled = previous


def new_parameter(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | None, fill: Fill) -> nn.Parameter:
    """A parameter of ``shape`` whose values ``fill`` writes: now, or when materialized (:func:`deferred_init`).

    On a meta ``device`` (the planner's shape-only models) nothing is drawn.
    """
    if _Deferral.enabled:
        param = nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"))
        param.deferred_fill = fill
        return param
    param = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
    if param.device.type != "meta":
        with torch.no_grad():
            fill(param)
    return param


def is_deferred(param: torch.Tensor) -> bool:
    """True for a parameter made inside :func:`deferred_init` that has not been materialized yet."""
    return "deferred_fill" in getattr(param, "__dict__", {})


def materialize(param: nn.Parameter, out: torch.Tensor) -> None:
    """Draw deferred ``param``'s values into ``out`` (its shape, dtype and device) and make ``param`` use
    ``out``'s memory. ``param`` stays the same Python object (modules, buckets and the tied-embedding
    lookups keep their references) with the same attributes (``tensor_model_parallel``, ...)."""
    fill = param.__dict__.pop("deferred_fill")
    with torch.no_grad():
        fill(out)
    # Like the eager path's `param.data = view`: `out`'s memory under the parameter's own autograd version
    # counter (nn.Parameter(out) would share out's, and ZeRO-3's gathers, which write the flat buffer `out`
    # is a view of, would then invalidate tensors saved for backward).
    real = nn.Parameter(torch.empty(0, dtype=out.dtype, device=out.device), requires_grad=param.requires_grad)
    real.data = out
    real.__dict__.update(param.__dict__)
    # A meta tensor cannot take real data through `param.data = ...` (incompatible tensor types): swap the
    # two objects' contents instead.
    torch.utils.swap_tensors(param, real)


def set_initial_values(param: nn.Parameter, value: torch.Tensor) -> None:
    """Give ``param`` the values ``value`` (e.g. from a pretrained checkpoint): now, or when it is drawn."""
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(f"cannot load a tensor of shape {tuple(value.shape)} into a parameter of shape "
                         f"{tuple(param.shape)}")
    if is_deferred(param):
        param.deferred_fill = lambda out: out.copy_(value)
    else:
        with torch.no_grad():
            param.copy_(value)


def load_initial_values(module: nn.Module, state: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """``module.load_state_dict(state, strict=False)`` that also works before deferred parameters are drawn
    (``load_state_dict`` silently skips meta parameters). Returns ``(missing, unexpected)`` names."""
    params = dict(module.named_parameters())
    for name, value in state.items():
        if name in params:
            set_initial_values(params[name], value)
    others = {name: value for name, value in state.items() if name not in params}  # buffers, unexpected keys
    missing, unexpected = module.load_state_dict(others, strict=False)
    return [name for name in missing if name not in state], list(unexpected)
