"""Run ``pretrain_gpt.py`` (or a tool) on N ranks and read the ``lm loss`` of every logged iteration.

``launch`` runs a script the way ``torchrun --nproc_per_node N script`` runs it (same argv, environment
variables, working directory, stdout), in ranks forked from the test harness's server, which has torch and
the trainer imported: a torchrun costs ~3 s of CPU per process started (launcher and each worker import
torch) before any work, and the CLI tests need the script's code path, not the launcher's. ``torchrun``
starts the real launcher, for the tests of the launcher itself (restarts, orphans) and one smoke run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*\| lm loss: ([0-9.E+-]+) \|")

# The command of the foundation issue's "Done when", without the launcher and the layout flags, and with one
# evaluation batch: the default --eval-iters 100 ran 100 global batches of test data after training (most of each
# run's CPU); one still takes every layout through the forward-only evaluation and its log line.
ISSUE_FLAGS = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--max-position-embeddings",
    "32",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--train-iters",
    "6",
    "--lr",
    "1e-3",
    "--mock-data",
    "--vocab-size",
    "512",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--log-interval",
    "1",
    "--seed",
    "1234",
    "--eval-iters",
    "1",
]


def in_process_run(flags: list[str], on_chunk: Callable | None = None) -> dict:
    """``train_gpt``'s result for the one-process run of ``flags``, trained in this process: the code and
    flags ``torchrun --nproc_per_node 1`` would run, without starting a launcher and a worker (~10 s each).
    The last two flags put back the command line's defaults that the harness's BASE_FLAGS change, but for
    ``--no-log-memory``: the log's memory figure (on in the CLI runs compared with this one) changes no number.
    ``on_chunk(chunk, ps)`` runs on the model chunk once built (``train_gpt``'s, e.g. to attach hooks)."""
    from tests.distributed.gpt_runs import train_gpt

    return train_gpt(0, 1, flags + ["--make-vocab-size-divisible-by", "128", "--adam-eps", "1e-8"],
                     on_chunk=on_chunk)


def in_process_losses(flags: list[str]) -> dict[int, float]:
    """``{iteration: lm loss}`` of :func:`in_process_run`."""
    return dict(enumerate(in_process_run(flags)["losses"], start=1))


def logged_values(stdout: str, name: str) -> dict[int, float]:
    """``{iteration: value}`` of the statistic ``name`` (e.g. ``load_balancing_loss``) on each training log line."""
    pattern = re.compile(rf"iteration\s+(\d+)/\s*\d+ \|.*\| {re.escape(name)}: ([0-9.E+-]+) \|")
    return {int(it): float(value) for it, value in pattern.findall(stdout)}


LAUNCHER_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


def _run_script_rank(rank: int, world_size: int, script: str, argv: list[str], launched: bool,
                     check: bool, output_dir: str | None = None) -> tuple[int, str, str]:
    """In a harness rank: ``python script *argv``, as a torchrun worker when ``launched`` (else without the
    launcher's variables, as from a shell); return (exit code, stdout, stderr), captured at the file
    descriptors (C++ and child-process output included). With ``output_dir`` they are captured in
    ``rank{rank}.out`` / ``.err`` there, readable while the script runs."""
    import multiprocessing
    import runpy
    import tempfile
    import traceback

    # A worker may start DataLoader workers, forked as under torchrun (the platform's default start method):
    # a harness rank is a daemon and inherits the fork-server method, which would start each loader worker
    # from a fresh interpreter (~10 s of CPU importing torch).
    multiprocessing.current_process().daemon = False
    multiprocessing.set_start_method(None, force=True)
    if not launched:
        for name in LAUNCHER_ENV:
            os.environ.pop(name, None)
    os.chdir(ROOT)
    path = str(ROOT / script)
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(path))  # what `python script` puts first on the path
    code = 0
    def capture(suffix: str):
        if output_dir is None:
            return tempfile.TemporaryFile("w+")
        return open(os.path.join(output_dir, f"rank{rank}.{suffix}"), "w+")

    with capture("out") as out, capture("err") as err:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        except BaseException:  # noqa: BLE001 - reported as the worker's traceback and exit status 1
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
        out.seek(0)
        err.seek(0)
        result = code, out.read(), err.read()
    if check and code != 0:  # raise at once: the harness stops the other ranks (as torchrun would)
        raise AssertionError(f"{script} exited {code} on rank {rank}:\n{result[1]}\n{result[2]}")
    return result


def launch(nproc: int, flags: list[str], script: str = "pretrain_gpt.py", timeout: float = 300) -> str:
    """What ``torchrun --standalone --nproc_per_node nproc script *flags`` prints on stdout (rank 0's output
    first), run in ranks forked from the harness's server; raise with the output when a rank exits non-zero.

    Each rank gets torchrun's rank variables, working directory, argv and ``sys.path``, not torchrun's
    elastic agent: the launcher's own behaviour (restarts, orphans) is tested with ``torchrun``."""
    from tests.distributed.harness import run_distributed

    results = run_distributed(_run_script_rank, nproc, script, list(flags), True, True, timeout=timeout)
    return "".join(out for _, out, _ in results)


class Launched:
    """The ranks of a long-running script (a server) started as ``launch`` starts them, not waited for.

    With ``output_dir``, rank r's stdout and stderr grow in ``output_dir/rank{r}.out`` / ``.err`` as it runs."""

    def __init__(self, nproc: int, flags: list[str], script: str, output_dir: str | None = None) -> None:
        from tests.distributed.harness import start_distributed

        self.processes, self._results = start_distributed(_run_script_rank, nproc, script, list(flags), True, False,
                                                          output_dir)
        self._reported: dict[int, tuple[bool, object]] = {}

    def _collect(self) -> None:
        while not self._results.empty():
            rank, ok, value = self._results.get()
            self._reported[rank] = ok, value

    def wait(self, rank: int, timeout: float) -> int | None:
        """The exit status of rank ``rank``'s script once it ended, None if it still runs after ``timeout`` s: the
        script's ``sys.exit`` code (1 for an exception), or the process's own status when it died or ``os._exit``-ed."""
        process = self.processes[rank]
        process.join(timeout)
        if process.exitcode is None:
            return None
        self._collect()
        if rank in self._reported:
            ok, value = self._reported[rank]
            return value[0] if ok else 1
        return process.exitcode

    def poll(self) -> int | None:
        """None while every rank runs, else the exit code of the first that ended (as ``Popen.poll``)."""
        for p in self.processes:
            if p.exitcode is not None:
                return p.exitcode
        return None

    def stop(self) -> str:
        """SIGTERM every rank (what torchrun forwards), then return the output of ranks that had ended."""
        for p in self.processes:
            p.terminate()
        for p in self.processes:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
                p.join()
        self._collect()
        outputs = []
        for rank, (ok, value) in sorted(self._reported.items()):
            outputs.append(f"rank {rank}: {value[1]}{value[2]}" if ok else f"rank {rank}: {value}")
        return "\n".join(outputs)


def serve(nproc: int, checkpoint: str, port: int, flags: list[str], timeout: float = 120) -> Launched:
    """``tools/text_generation_server.py --load checkpoint --port port *flags`` on ``nproc`` ranks, once it listens."""
    import socket
    import time

    server = Launched(nproc, ["--load", checkpoint, "--port", str(port), *flags], "tools/text_generation_server.py")
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"server did not start:\n{server.stop()}") from None
            time.sleep(0.3)


def run_script(script: str, *args: object, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python script *args`` from the repository root (as from a shell, no launcher variables), in a process
    forked from the harness's server; raise with its output when ``check`` and it exits non-zero."""
    from tests.distributed.harness import run_distributed

    argv = [str(a) for a in args]
    [(code, out, err)] = run_distributed(_run_script_rank, 1, script, argv, False, check, timeout=timeout)
    return subprocess.CompletedProcess([sys.executable, script, *argv], code, out, err)


def forked_torchrun_command(command: list[str], **_: object) -> subprocess.CompletedProcess:
    """What ``subprocess.run(command, capture_output=True, text=True)`` returns for a ``python -m
    torch.distributed.run ... script args`` command that a tool builds, with the ranks forked as ``launch`` forks
    them: the command is parsed by torchrun's own argument parser (a flag torchrun would refuse fails here too), and
    ``--nproc_per_node`` ranks run ``script args`` with torchrun's rank variables. For tests of a tool that starts
    torchrun (stand in for its ``subprocess.run``); the launcher itself is tested with ``torchrun``."""
    from torch.distributed.run import get_args_parser

    from tests.distributed.harness import run_distributed

    assert command[:3] == [sys.executable, "-m", "torch.distributed.run"], command
    args = get_args_parser().parse_args(command[3:])
    assert not args.module and not args.no_python, command
    results = run_distributed(_run_script_rank, int(args.nproc_per_node), args.training_script,
                              list(args.training_script_args), True, False)
    code = next((c for c, _, _ in results if c != 0), 0)
    return subprocess.CompletedProcess(command, code, "".join(o for _, o, _ in results),
                                       "".join(e for _, _, e in results))


def torchrun(nproc: int, flags: list[str], script: str = "pretrain_gpt.py", timeout: float = 300) -> str:
    """Launch ``script`` on ``nproc`` CPU processes; return stdout (raise with the output on failure)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        script,
        *flags,
    ]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout)
    if result.returncode != 0:
        raise AssertionError(f"{' '.join(command)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result.stdout


def documented_launch(page: str, script: str = "pretrain_gpt.py") -> tuple[int, list[str]]:
    """The first ``bash`` block of ``docs/<page>``, a ``torchrun --nproc_per_node=N script flags`` command:
    ``(N, flags)``."""
    import shlex

    text = (ROOT / "docs" / page).read_text()
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    words = shlex.split(block.replace("\\\n", " "))
    at = words.index(script)
    [nproc] = [int(w.split("=")[1]) for w in words[:at] if w.startswith("--nproc_per_node=")]
    return nproc, words[at + 1:]


def logged_losses(stdout: str) -> dict[int, float]:
    """``{iteration: lm loss}`` from Megatron log lines."""
    return {int(it): float(loss) for it, loss in LOSS.findall(stdout)}


def run_data_tool(name: str, *args: object, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``data_tools/<name>`` with ``args`` as ``run_script`` does (a fresh interpreter cost ~0.5 s per call,
    and the suite makes dozens); raise with its stderr when ``check`` and it fails."""
    proc = run_script(f"data_tools/{name}", *args, check=False, timeout=120)
    if check and proc.returncode != 0:
        raise AssertionError(f"{name} exited {proc.returncode}:\n{proc.stderr}")
    return proc
