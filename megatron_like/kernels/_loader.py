"""Lazy access to the compiled kernels in ``megatron_like._csrc`` with a single warning when missing.

Each ``csrc/<name>.cpp`` is built (at install) into the module ``megatron_like._csrc.<name>``. Wrappers
ask :func:`load` for it on every call, so ``MEGATRON_LIKE_NO_CSRC=1`` forces the pure-PyTorch fallbacks.
The variable is read once, when this module is imported: reading ``os.environ`` on every fused op was a third
of the cost of the op's choice of kernel (docs/kernels.md). :func:`refresh_environment` is the one way to re-read
it in a running process (``pretrain()`` calls it at start-up; tests call it after ``monkeypatch.setenv``,
and tests/conftest.py after every test, when monkeypatch has put the environment back).

``MEGATRON_LIKE_ISA=avx512|avx2|scalar`` forces the vector path of every kernel module: :func:`load`
pins each module to it when it first imports it (an error if the CPU lacks that path). This is the one
place the variable is read; ``scripts/isa_env.sh`` maps it to PyTorch's own switches (docs/kernels.md).
"""

from __future__ import annotations

import importlib
import os
import warnings
from types import ModuleType

NO_CSRC_ENV = "MEGATRON_LIKE_NO_CSRC"
"""Set to 1 to force the pure-PyTorch fallbacks even when the compiled kernels are installed."""

ISA_ENV = "MEGATRON_LIKE_ISA"
"""Set to avx512, avx2 or scalar to force that kernel path (default: the widest the CPU has)."""
ISA_ENV_ALIAS = "MEGATRON_LIKE_CSRC_ISA"
"""The older name of ``MEGATRON_LIKE_ISA``, still honoured."""
ISAS = ("scalar", "avx2", "avx512")
"""The kernel paths, narrowest first."""
CUDA_MODULE_PREFIX = "cuda_"
"""``csrc/cuda/<op>.cu`` builds ``megatron_like._csrc.cuda_<op>``: a CUDA twin, which has no ISA switch."""

_cache: dict[str, ModuleType | None] = {}
_warned = False


def _read_no_csrc() -> bool:
    return os.environ.get(NO_CSRC_ENV, "").strip().lower() not in ("", "0", "false", "no")


_no_csrc = _read_no_csrc()
"""``MEGATRON_LIKE_NO_CSRC`` as read at import or by the last :func:`refresh_environment`."""


def refresh_environment() -> None:
    """Re-read ``MEGATRON_LIKE_NO_CSRC``: the one way a change of it in a running process takes effect.

    (``MEGATRON_LIKE_ISA`` needs no refresh: it is read when a module is first loaded and by
    :func:`set_csrc_isa`, never per op.)
    """
    global _no_csrc
    _no_csrc = _read_no_csrc()


def csrc_disabled() -> bool:
    """Return True when ``MEGATRON_LIKE_NO_CSRC`` asks for the fallbacks (as of the last refresh)."""
    return _no_csrc


def _warn_missing(name: str, error: Exception) -> None:
    global _warned
    if _warned:
        return
    _warned = True
    warnings.warn(
        f"megatron_like: compiled kernels are unavailable (importing megatron_like._csrc.{name} failed: "
        f"{error}); using the slower pure-PyTorch fallbacks. Rebuild them with "
        "`pip install -e . --no-build-isolation` (needs a C++ compiler), or set "
        f"{NO_CSRC_ENV}=1 to silence this.",
        RuntimeWarning,
        stacklevel=3,
    )


def forced_isa() -> str | None:
    """Return the path ``MEGATRON_LIKE_ISA`` (or its alias) forces, None when unset; ValueError if invalid."""
    values = {var: os.environ.get(var, "").strip().lower() for var in (ISA_ENV, ISA_ENV_ALIAS)}
    values = {var: value for var, value in values.items() if value}
    for var, value in values.items():
        if value not in ISAS:
            raise ValueError(f"{var}={value!r} is not a kernel path: set it to avx512, avx2 or scalar, or unset it")
    if len(set(values.values())) > 1:
        raise ValueError(f"{ISA_ENV}={values[ISA_ENV]} and {ISA_ENV_ALIAS}={values[ISA_ENV_ALIAS]} disagree: "
                         f"set only {ISA_ENV}")
    return next(iter(values.values()), None)


def check_isa_supported(isa: str, best: str) -> None:
    """Raise a one-line RuntimeError when the forced path ``isa`` is wider than ``best``, the CPU's widest."""
    if ISAS.index(isa) > ISAS.index(best):
        raise RuntimeError(f"{ISA_ENV}={isa} asks for the {isa} kernels, but this CPU's widest path is {best}: "
                           f"unset {ISA_ENV} or set it to one of {', '.join(ISAS[:ISAS.index(best) + 1])}")


def default_isa(module: ModuleType) -> str:
    """The path ``module`` runs unless pinned: the forced one if set (checked against the CPU), else the widest."""
    best = module.best_isa()
    isa = forced_isa()
    if isa is None:
        return best
    check_isa_supported(isa, best)
    return isa


def has_isa_switch(name: str) -> bool:
    """Return whether module ``name`` binds ``set_isa``/``best_isa``: the CPU modules do, CUDA twins do not."""
    return not name.startswith(CUDA_MODULE_PREFIX)


def load(name: str) -> ModuleType | None:
    """Return the compiled module ``megatron_like._csrc.<name>``, or None (fallback) if disabled/missing.

    On first import a CPU module is pinned to :func:`default_isa` (``MEGATRON_LIKE_ISA`` or the CPU's
    widest); a CUDA twin (``cuda_<op>``) binds only its kernels and is used as imported.
    """
    if _no_csrc:
        return None
    if name not in _cache:
        try:
            module = importlib.import_module(f"megatron_like._csrc.{name}")
        except ImportError as error:
            _cache[name] = None
            _warn_missing(name, error)
        else:
            if has_isa_switch(name):
                module.set_isa(default_isa(module))
            _cache[name] = module
    return _cache[name]


def csrc_available(name: str | None = None) -> bool:
    """Return whether compiled kernels will run: module ``name``, or by default all of this package's."""
    names = [name] if name is not None else list(KERNEL_MODULES)
    return all(load(n) is not None for n in names)


def csrc_isa() -> str | None:
    """Return the vector path the kernels dispatch to ("avx512", "avx2", "scalar"), None without csrc."""
    module = load("layer_norm")
    return None if module is None else module.isa()


def set_csrc_isa(name: str | None) -> None:
    """Pin every kernel module to the "avx512", "avx2" or "scalar" path (None: back to :func:`default_isa`).

    For tests and benchmarks of the narrower paths; raises ValueError if the CPU lacks that ISA.
    """
    for module_name in KERNEL_MODULES:
        module = load(module_name)
        if module is not None:
            module.set_isa(default_isa(module) if name is None else name)


KERNEL_MODULES = (
    "scaled_masked_softmax",
    "scaled_upper_triang_masked_softmax",
    "layer_norm",
    "bias_gelu",
    "vocab_cross_entropy",
    "cpu_adam",
    "rms_norm",
    "swiglu",
    "rotary",
    "grouped_gemm",
)
"""The extension modules the wrappers in this package use."""

