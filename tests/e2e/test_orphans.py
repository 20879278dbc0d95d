"""No torchrun worker survives its launcher (``megatron_like/launcher_guard.py``): ``kill -9`` of the launcher's
process group (torchrun starts its workers in sessions of their own, so the group kill does not reach them) ends
both workers of a 2-process torchrun; ``kill -9`` of the launcher alone ends the worker of a 1-process torchrun run
under a sub-reaper (tini, systemd: the orphan's new parent is not pid 1)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.e2e.cli import ROOT
from tests.e2e.test_fault import child_pids, gpt_flags, wait_for_line


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its reaper counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


SUB_REAPER = """
import ctypes, os, subprocess, sys
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans below come here, not to init
launcher = subprocess.Popen(sys.argv[1:])
print(launcher.pid, flush=True)
while True:  # reap the launcher and every orphan until none is left
    try:
        os.wait()
    except ChildProcessError:
        break
"""


def test_no_torchrun_worker_survives_its_launcher(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    flags = ["pretrain_gpt.py", *gpt_flags(), "--num-workers", "0", "--save-interval", "5"]
    commands = {
        "process group": [*torchrun, "--nproc_per_node", "2", *flags, "--tensor-model-parallel-size", "2"],
        "launcher only, under a sub-reaper": [sys.executable, "-c", SUB_REAPER, *torchrun, "--nproc_per_node", "1",
                                              *flags],
    }
    agents = {how: subprocess.Popen(command + ["--save", str(tmp_path / how[:8].replace(" ", "_"))], cwd=ROOT,
                                    env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    start_new_session=True)  # its own process group, as in a shell
              for how, command in commands.items()}
    workers = {}
    try:
        launcher = int(agents["launcher only, under a sub-reaper"].stdout.readline())
        launchers = {"process group": agents["process group"].pid, "launcher only, under a sub-reaper": launcher}
        for how, agent in agents.items():
            wait_for_line(agent, "iteration        2/")
            workers[how] = child_pids(launchers[how])
        assert [len(pids) for pids in workers.values()] == [2, 1], workers
        os.killpg(agents["process group"].pid, signal.SIGKILL)  # kill -9 -- -PGID
        os.kill(launcher, signal.SIGKILL)
        deadline = time.monotonic() + 120  # a bound for a loaded machine, not a timing claim
        while any(alive(pid) for pids in workers.values() for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        survivors = {how: [pid for pid in pids if alive(pid)] for how, pids in workers.items()}
        assert not any(survivors.values()), f"orphaned workers still run: {survivors}"
    finally:
        for pids in workers.values():
            for pid in pids:
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)
        for agent in agents.values():
            if agent.poll() is None:
                agent.kill()
            agent.communicate()
