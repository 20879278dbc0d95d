"""No torchrun worker survives its launcher: ``kill -9`` of the launcher's process group (torchrun
starts its workers in sessions of their own, so the group kill does not reach them), or of the launcher
alone, ends both workers (``megatron_like/launcher_guard.py``)."""

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


def test_no_torchrun_worker_survives_its_launcher(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    agents = {}
    for how in ("process group", "launcher only"):
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                   "pretrain_gpt.py", *gpt_flags(), "--tensor-model-parallel-size", "2", "--num-workers", "0",
                   "--save", str(tmp_path / how.replace(" ", "_")), "--save-interval", "5"]
        agents[how] = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True, start_new_session=True)  # its own process group, as in a shell
    workers = {}
    try:
        for how, agent in agents.items():
            wait_for_line(agent, "iteration        2/")
            workers[how] = child_pids(agent.pid)
            assert len(workers[how]) == 2, workers
        os.killpg(agents["process group"].pid, signal.SIGKILL)  # kill -9 -- -PGID
        os.kill(agents["launcher only"].pid, signal.SIGKILL)
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


def test_a_one_process_torchrun_worker_dies_with_its_launcher_under_a_sub_reaper(tmp_path):
    """tini or systemd as a sub-reaper adopts the orphan (its parent is not 1), and torchrun with one process
    must arm the guard too."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-c", SUB_REAPER, sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", "1", "pretrain_gpt.py", *gpt_flags(), "--num-workers", "0"]
    reaper = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    workers = []
    try:
        launcher = int(reaper.stdout.readline())
        wait_for_line(reaper, "iteration        2/")
        workers = child_pids(launcher)
        assert len(workers) == 1, workers
        os.kill(launcher, signal.SIGKILL)
        deadline = time.monotonic() + 120  # a bound for a loaded machine, not a timing claim
        while alive(workers[0]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive(workers[0]), "the worker outlived its launcher"
    finally:
        for pid in workers:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        reaper.kill()
        reaper.communicate()
