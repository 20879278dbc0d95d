"""Shared fixture for the kernel tests: run each test on every compiled ISA path and on the fallback.

Params: "avx512", "avx2", "scalar" pin the C++ kernels to that vector path (skipped when the CPU lacks
it, or when MEGATRON_LIKE_ISA forces the session onto a narrower one); "fallback" sets
MEGATRON_LIKE_NO_CSRC=1 so the pure-PyTorch implementation runs. A missing build fails the compiled
params (the README setup must build csrc/) unless MEGATRON_LIKE_NO_CSRC was set for the whole session.
"""

from __future__ import annotations

import pytest
import torch

from megatron_like.kernels import _loader

BACKENDS = ["avx512", "avx2", "scalar", "fallback"]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """Yield the backend name with the kernels switched to it; restores the default ISA afterwards."""
    name = request.param
    torch.manual_seed(1234)  # tests that draw without a generator stay reproducible
    if name == "fallback":
        monkeypatch.setenv(_loader.NO_CSRC_ENV, "1")
        _loader.refresh_environment()  # tests/conftest.py refreshes again once monkeypatch has undone it
        assert _loader.load("layer_norm") is None, "the fallback param would run the compiled kernels"
        yield name
        return
    if _loader.csrc_disabled():
        pytest.skip("MEGATRON_LIKE_NO_CSRC is set for this session")
    if not _loader.csrc_available():
        pytest.fail("compiled kernels are not built: run `pip install -e . --no-build-isolation`")
    module = _loader.load("layer_norm")
    widest = _loader.default_isa(module)
    if _loader.ISAS.index(name) > _loader.ISAS.index(widest):
        forced = module.best_isa() != widest
        pytest.skip(f"{_loader.ISA_ENV}={widest} forces a narrower path" if forced else f"this CPU has no {name}")
    _loader.set_csrc_isa(name)
    try:
        yield name
    finally:
        _loader.set_csrc_isa(None)


def compiled(backend_name: str) -> bool:
    """Return whether the compiled kernels run under this backend param."""
    return backend_name != "fallback" and not _loader.csrc_disabled()
