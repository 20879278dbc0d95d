"""pretrain()'s start-up settings: glibc keeps freed memory on CPU (--no-keep-freed-memory turns it off), and the
kernels re-read MEGATRON_LIKE_NO_CSRC."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_like.kernels import _loader
from megatron_like.training import process_setup
from tests.distributed.gpt_runs import train_gpt

ROOT = Path(__file__).resolve().parents[2]
# Rounds of 6 blocks of 4 MiB and one of 48 MiB, written and freed together. With glibc's defaults the 48 MiB one
# gets its own mmap (above glibc's largest mmap threshold, 32 MiB) and the free top of the heap passes its adaptive
# trim threshold (8 MiB here) and goes back to the system, so every round faults its 72 MiB in again (18 k
# pages); kept, a round reuses the pages of the one before. The blocks come straight from malloc: a torch tensor's
# small C++ objects can land above them and keep the defaults from trimming in some runs.
CHILD = """
import ctypes, importlib.util, json, resource, sys, types

# This file alone, without torch or the package (a tenth of the start-up): only device.type is read.
spec = importlib.util.spec_from_file_location("process_setup", sys.argv[1])
process_setup = sys.modules["process_setup"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
spec.loader.exec_module(process_setup)
keep_freed_memory, CPU = process_setup.keep_freed_memory, types.SimpleNamespace(type="cpu")

libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
SIZES = [4 << 20] * 6 + [48 << 20]

def faults_of_rounds():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(2):
        blocks = [libc.malloc(size) for size in SIZES]
        for block, size in zip(blocks, SIZES):
            libc.memset(block, 1, size)
        for block in reversed(blocks):
            libc.free(block)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

faults_of_rounds()  # first touch
report = {"defaults": faults_of_rounds()}
report["off"] = [keep_freed_memory(False, CPU).kept, faults_of_rounds()]
kept = keep_freed_memory(True, CPU)
faults_of_rounds()  # the heap grows once under the new thresholds
report["kept"] = [kept.kept, faults_of_rounds(), kept.reason]
print(json.dumps(report))
"""


def test_kept_freed_memory_is_not_faulted_in_again_and_the_flag_leaves_glibc_alone():
    """In a fresh process (the setting is process-wide): glibc's defaults fault a repeated 72 MiB in every round;
    ``keep_freed_memory(False, cpu)`` changes nothing; ``keep_freed_memory(True, cpu)`` stops the faults, of the
    blocks above glibc's largest mmap threshold too."""
    on_gpu = process_setup.keep_freed_memory(True, torch.device("cuda"))  # builds no CUDA context
    assert on_gpu == process_setup.FreedMemorySetting(False, "glibc's default trimming (the activations live on cuda)")
    if process_setup._glibc() is None:
        setting = process_setup.keep_freed_memory(True, torch.device("cpu"))
        assert not setting.kept and "not glibc" in setting.reason
        return
    done = subprocess.run([sys.executable, "-c", CHILD, process_setup.__file__], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    pages_per_round = (6 * (4 << 20) + (48 << 20)) // 4096
    assert report["defaults"] > 1.5 * pages_per_round, report  # the premise: defaults fault each round in
    assert report["off"][0] is False and report["off"][1] > 1.5 * pages_per_round, report
    assert report["kept"][0] is True and report["kept"][1] < pages_per_round // 10, report
    assert "--no-keep-freed-memory" in report["kept"][2]


def test_pretrain_keeps_freed_memory_on_cpu_and_rereads_the_kernel_environment(monkeypatch,
                                                                                 compiled_modules_loaded):
    """pretrain() makes the setting (recorded per call) unless --no-keep-freed-memory, and the kernels see
    MEGATRON_LIKE_NO_CSRC as it is when training starts, though nothing refreshed them after it was set."""
    if not _loader.csrc_available():
        pytest.fail("compiled kernels are not built: run `pip install -e . --no-build-isolation`")
    used = compiled_modules_loaded
    monkeypatch.setattr(process_setup, "_applied", None)  # not what an earlier test's pretrain() did
    monkeypatch.setenv(_loader.NO_CSRC_ENV, "1")
    flags = ["--train-iters", "1", "--global-batch-size", "2"]
    train_gpt(0, 1, flags)
    assert used == set(), "pretrain() did not re-read MEGATRON_LIKE_NO_CSRC"
    assert process_setup.applied_setting().kept == (process_setup._glibc() is not None)
    monkeypatch.delenv(_loader.NO_CSRC_ENV)
    train_gpt(0, 1, flags + ["--no-keep-freed-memory"])
    assert "bias_gelu" in used  # the compiled kernels are back once the variable is gone
    assert process_setup.applied_setting() == process_setup.FreedMemorySetting(
        False, "glibc's default trimming (--no-keep-freed-memory)")
