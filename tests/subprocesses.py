"""Run several independent commands at once, as a test module's fixture: on the 2-core test machine one
command (a compiler, a fresh Python importing torch) uses one core, and pytest waits on the other."""

from __future__ import annotations

import subprocess
from typing import Any


def run_at_once(runs: dict[str, dict[str, Any]], timeout: float = 300) -> dict[str, subprocess.CompletedProcess]:
    """``{name: subprocess.run(**kwargs, capture_output=True, text=True)}`` for ``{name: kwargs}``, every command
    started before any is waited for; a command still running when another's wait fails is killed."""
    processes = {name: subprocess.Popen(**kwargs, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for name, kwargs in runs.items()}
    try:
        outputs = {name: p.communicate(timeout=timeout) for name, p in processes.items()}
    finally:
        for p in processes.values():
            p.kill()  # nothing once it exited
    return {name: subprocess.CompletedProcess(p.args, p.returncode, *outputs[name]) for name, p in processes.items()}
