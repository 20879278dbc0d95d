"""The kernel loader: MEGATRON_LIKE_NO_CSRC, one warning for a missing build, ISA pinning (MEGATRON_LIKE_ISA)."""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch

from megatron_like.kernels import _loader, layer_norm


def test_no_csrc_env_forces_fallback(monkeypatch):
    monkeypatch.setenv(_loader.NO_CSRC_ENV, "1")
    _loader.refresh_environment()
    assert _loader.load("layer_norm") is None
    assert not _loader.csrc_available()


def test_missing_extension_warns_once_and_falls_back(monkeypatch):
    monkeypatch.delenv(_loader.NO_CSRC_ENV, raising=False)
    _loader.refresh_environment()
    monkeypatch.setattr(_loader, "_cache", {})
    monkeypatch.setattr(_loader, "_warned", False)
    real_import = importlib.import_module

    def fail_csrc(name, *args):
        if name.startswith("megatron_like._csrc."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args)

    monkeypatch.setattr(_loader.importlib, "import_module", fail_csrc)
    x = torch.randn(3, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = layer_norm(x, None, None)
        layer_norm(x, None, None)
        assert _loader.load("bias_gelu") is None
    messages = [w for w in caught if "compiled kernels are unavailable" in str(w.message)]
    assert len(messages) == 1
    assert "pip install -e ." in str(messages[0].message)
    torch.testing.assert_close(y, torch.nn.functional.layer_norm(x, (8,)))


def test_compiled_modules_report_and_pin_isa(monkeypatch):
    monkeypatch.delenv(_loader.NO_CSRC_ENV, raising=False)
    _loader.refresh_environment()
    if not _loader.csrc_available():
        pytest.fail("compiled kernels are not built: run `pip install -e . --no-build-isolation`")
    module = _loader.load("scaled_masked_softmax")
    best = module.best_isa()
    assert best in ("avx512", "avx2", "scalar")
    try:
        _loader.set_csrc_isa("scalar")
        assert all(_loader.load(name).isa() == "scalar" for name in _loader.KERNEL_MODULES)
    finally:
        _loader.set_csrc_isa(None)
    assert module.isa() == _loader.default_isa(module) == (_loader.forced_isa() or best)
    assert module.openmp()


def test_no_csrc_is_read_once_until_refresh_environment(monkeypatch):
    """The per-op choice reads no environment: a change takes effect at ``refresh_environment()``, both ways."""
    monkeypatch.delenv(_loader.NO_CSRC_ENV, raising=False)
    _loader.refresh_environment()
    if not _loader.csrc_available():
        pytest.fail("compiled kernels are not built: run `pip install -e . --no-build-isolation`")
    monkeypatch.setenv(_loader.NO_CSRC_ENV, "1")
    assert _loader.load("layer_norm") is not None and not _loader.csrc_disabled()
    _loader.refresh_environment()
    assert _loader.load("layer_norm") is None and _loader.csrc_disabled()
    monkeypatch.setenv(_loader.NO_CSRC_ENV, "0")
    _loader.refresh_environment()
    assert _loader.load("layer_norm") is not None


def test_set_no_csrc_and_leave_it_to_monkeypatch(monkeypatch):
    """The first half of the next test: leaves the kernels disabled when its body ends."""
    monkeypatch.setenv(_loader.NO_CSRC_ENV, "1")
    _loader.refresh_environment()
    assert _loader.csrc_disabled()


def test_a_test_that_set_no_csrc_leaves_no_stale_choice():
    """Runs after the test above (file order): tests/conftest.py re-read the variable once monkeypatch restored it."""
    assert _loader.csrc_disabled() == _loader._read_no_csrc()
