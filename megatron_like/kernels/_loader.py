"""Lazy access to the compiled kernels in ``megatron_like._csrc`` with a single warning when missing.

Each ``csrc/<name>.cpp`` is built (at install) into the module ``megatron_like._csrc.<name>``. Wrappers
ask :func:`load` for it on every call, so ``MEGATRON_LIKE_NO_CSRC=1`` (read at call time, which lets
tests flip it with ``monkeypatch.setenv``) forces the pure-PyTorch fallbacks at any moment.
"""

from __future__ import annotations

import importlib
import os
import warnings
from types import ModuleType

NO_CSRC_ENV = "MEGATRON_LIKE_NO_CSRC"
"""Set to 1 to force the pure-PyTorch fallbacks even when the compiled kernels are installed."""

_cache: dict[str, ModuleType | None] = {}
_warned = False


def csrc_disabled() -> bool:
    """Return True when ``MEGATRON_LIKE_NO_CSRC`` asks for the fallbacks."""
    return os.environ.get(NO_CSRC_ENV, "").strip().lower() not in ("", "0", "false", "no")


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


def load(name: str) -> ModuleType | None:
    """Return the compiled module ``megatron_like._csrc.<name>``, or None (fallback) if disabled/missing."""
    if csrc_disabled():
        return None
    if name not in _cache:
        try:
            _cache[name] = importlib.import_module(f"megatron_like._csrc.{name}")
        except ImportError as error:
            _cache[name] = None
            _warn_missing(name, error)
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
    """Pin every kernel module to the "avx512", "avx2" or "scalar" path (None: the CPU's best).

    For tests and benchmarks of the narrower paths; raises ValueError if the CPU lacks that ISA.
    """
    for module_name in KERNEL_MODULES:
        module = load(module_name)
        if module is not None:
            module.set_isa(module.best_isa() if name is None else name)


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
)
"""The extension modules the wrappers in this package use."""
