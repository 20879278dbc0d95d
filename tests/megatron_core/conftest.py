"""tests/megatron_core runs Megatron-core itself (CPU, gloo, one process) and is skipped where it is not
importable: the suite never depends on it. To run it: ``.venv/bin/pip install --no-deps megatron-core==0.16.1``
(its only other needs, torch, numpy and packaging, are installed), or put an unpacked wheel on ``PYTHONPATH``, then
``.venv/bin/python -m pytest -q tests/megatron_core``. Each test is reported as skipped with the reason below,
never as passed.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

NO_MEGATRON_CORE = ("megatron-core is not installed: tests/megatron_core runs with `pip install --no-deps "
                    "megatron-core==0.16.1` (optional, outside the default suite's needs)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None:
        return
    skip = pytest.mark.skip(reason=NO_MEGATRON_CORE)
    for item in items:
        if item.path.is_relative_to(Path(__file__).parent):
            item.add_marker(skip)
