"""Fixtures every test gets."""

from __future__ import annotations

import pytest

from megatron_like.kernels import _common, _loader


@pytest.fixture(autouse=True)
def kernel_environment_as_set():
    """The kernels see MEGATRON_LIKE_NO_CSRC as the environment holds it when a test starts and after it ends.

    The kernels read the variable once (megatron_like/kernels/_loader.py); this fixture is set up before a
    test's monkeypatch and torn down after monkeypatch puts the environment back, so a test that set it (and
    called ``refresh_environment``) leaves no stale choice of kernels to the tests after it.
    """
    _loader.refresh_environment()
    yield
    _loader.refresh_environment()


@pytest.fixture
def compiled_modules_loaded(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """The names of the compiled modules the kernel wrappers load from now on (a wrapper that silently took its
    PyTorch path leaves its module out, so tests assert on the set)."""
    used: set[str] = set()

    def spy_load(name: str):
        module = _loader.load(name)
        if module is not None:
            used.add(name)
        return module

    monkeypatch.setattr(_common, "load", spy_load)
    return used
