"""A pytest plugin: CPU seconds (user + system) of each test, as a figure that holds on a loaded machine.

    .venv/bin/python -m pytest -p tests.cpu_seconds -p no:randomly tests ...   # writes cpu_seconds.json

Counted: the pytest process, every child it waited for (torchrun, tools) with their own waited children, and
the harness's fork server's children (the ranks it reaped; /proc/PID/stat cutime + cstime). Each test's row is
``{"nodeid", "cpu", "wall"}``; ``CPU_SECONDS_OUT`` names the file. Multi-process tests inflate somewhat under
load (ranks wait longer for each other), so compare figures taken under similar load.
"""

from __future__ import annotations

import json
import os
import resource
import time

import pytest

_TICKS = os.sysconf("SC_CLK_TCK")
_rows: list[dict] = []


def _fork_server_cpu() -> float:
    from multiprocessing import forkserver

    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if not pid:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(x) for x in fields[11:15]) / _TICKS  # utime, stime, cutime, cstime


def _cpu() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + _fork_server_cpu()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    cpu, wall = _cpu(), time.monotonic()
    yield
    _rows.append({"nodeid": item.nodeid, "cpu": _cpu() - cpu, "wall": time.monotonic() - wall})


def pytest_sessionfinish(session, exitstatus):
    with open(os.environ.get("CPU_SECONDS_OUT", "cpu_seconds.json"), "w") as f:
        json.dump(_rows, f, indent=0)
