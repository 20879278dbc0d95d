"""Shared pieces of tests/gpu: the CUDA device, the skip without one, and a spy on the kernels' CUDA twins.

Every test here runs only where ``torch.cuda.is_available()``; elsewhere each is reported as skipped with the
reason below (never as passed). ``bash scripts/gpu_check.sh`` builds the CUDA twins and runs this suite.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_like.kernels import _common, _loader
from megatron_like.parallel_state import ParallelState

NO_CUDA = "no CUDA device: tests/gpu runs on a GPU machine (bash scripts/gpu_check.sh)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=NO_CUDA)
    for item in items:
        if item.path.is_relative_to(Path(__file__).parent):
            item.add_marker(skip)


@pytest.fixture
def device() -> torch.device:
    """The CUDA device, as the code picks it (``parallel_state`` is the one place that decides)."""
    picked = ParallelState.single_process().device
    assert picked.type == "cuda", f"parallel_state picked {picked} although CUDA is available"
    return picked


@pytest.fixture
def twins_used(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """The set of compiled modules the kernel wrappers load from now on; a CUDA twin that is not built fails
    (unless ``MEGATRON_LIKE_NO_CSRC`` asks for the PyTorch paths).

    A wrapper that silently took the PyTorch path would leave its twin out of the set, so tests assert on it.
    """
    monkeypatch.delenv(_loader.NO_CSRC_ENV, raising=False)
    used: set[str] = set()

    def spy_load(name: str):
        module = _loader.load(name)
        if module is None and not _loader.has_isa_switch(name) and not _loader.csrc_disabled():
            pytest.fail(f"megatron_like._csrc.{name} is not built: run `bash scripts/gpu_check.sh` (builds "
                        "csrc/cuda/*.cu with nvcc)")
        if module is not None:
            used.add(name)
        return module

    monkeypatch.setattr(_common, "load", spy_load)
    return used

