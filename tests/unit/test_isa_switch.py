"""MEGATRON_LIKE_ISA forces the kernel path, and scripts/isa_env.sh makes PyTorch take the same one.

A Python started the way scripts/test.sh starts pytest (the script sourced first) must report the forced
path from every kernel module, from ATen (``torch.backends.cpu.get_cpu_capability()``) and from oneDNN
(its verbose log names the ISA it dispatches to), so the switch cannot silently do nothing. MKL is
switched too (MKL_ENABLE_INSTRUCTIONS) but reports no code path on non-Intel CPUs, so it is not checked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_like.kernels import _loader

ROOT = Path(__file__).resolve().parents[2]
TORCH_CAPABILITY = {"avx512": "AVX512", "avx2": "AVX2", "scalar": "DEFAULT"}
ONEDNN_ISA = {"avx2": "isa:Intel AVX2", "scalar": "isa:Intel SSE4.1"}
SWITCHES = (_loader.ISA_ENV, _loader.ISA_ENV_ALIAS, "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS",
            "ONEDNN_MAX_CPU_ISA", _loader.NO_CSRC_ENV)
PROBE = """
import json, torch
from megatron_like.kernels import _loader
torch.nn.functional.conv2d(torch.randn(2, 32, 16, 16), torch.randn(32, 32, 3, 3))  # oneDNN logs its ISA
print(json.dumps({"torch": torch.backends.cpu.get_cpu_capability(),
                  "kernels": sorted({_loader.load(name).isa() for name in _loader.KERNEL_MODULES})}))
"""


def compiled_kernels():
    """The layer_norm module (every module shares the CPU detection); fails the test if csrc is not built."""
    if _loader.csrc_disabled():
        pytest.skip(f"{_loader.NO_CSRC_ENV} is set for this session")
    if not _loader.csrc_available():
        pytest.fail("compiled kernels are not built: run `pip install -e . --no-build-isolation`")
    return _loader.load("layer_norm")


def sourced(env_var: str, value: str, code: str) -> dict:
    """``subprocess.run`` arguments of ``bash -c 'source scripts/isa_env.sh && python -c code'`` with
    ``env_var=value``, nothing else forced."""
    env = {k: v for k, v in os.environ.items() if k not in SWITCHES}
    env.update({env_var: value, "ONEDNN_VERBOSE": "1", "PYTHONPATH": str(ROOT)})
    command = f'source scripts/isa_env.sh && exec "{sys.executable}" -c "$0"'
    return {"args": ["bash", "-c", command, code], "cwd": ROOT, "env": env}


def run_sourced(env_var: str, value: str, code: str) -> subprocess.CompletedProcess:
    return subprocess.run(**sourced(env_var, value, code), capture_output=True, text=True, timeout=300)


FORCED = [(_loader.ISA_ENV, "avx2"), (_loader.ISA_ENV_ALIAS, "scalar")]


@pytest.fixture(scope="module")
def probes() -> dict[str, subprocess.CompletedProcess]:
    """The probe under each forced path this CPU has, every Python started at once (each imports torch)."""
    from tests.subprocesses import run_at_once

    best = _loader.ISAS.index(compiled_kernels().best_isa())
    return run_at_once({isa: sourced(env_var, isa, PROBE) for env_var, isa in FORCED
                        if _loader.ISAS.index(isa) <= best})


@pytest.mark.parametrize(("env_var", "isa"), FORCED)
def test_forced_isa_reaches_our_kernels_aten_and_onednn(probes, env_var, isa):
    if isa not in probes:
        pytest.skip(f"this CPU has no {isa}")
    done = probes[isa]
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report == {"torch": TORCH_CAPABILITY[isa], "kernels": [isa]}
    assert ONEDNN_ISA[isa] in done.stdout, [line for line in done.stdout.splitlines() if "isa:" in line]


def test_this_session_runs_on_the_forced_isa():
    """Under ``MEGATRON_LIKE_ISA=avx2 bash scripts/test.sh`` the suite itself runs on AVX2 (else the widest)."""
    module = compiled_kernels()
    forced = _loader.forced_isa()
    assert _loader.csrc_isa() == (forced or module.best_isa())
    if forced is not None and forced != module.best_isa():
        assert torch.backends.cpu.get_cpu_capability() == TORCH_CAPABILITY[forced], "source scripts/isa_env.sh"


def test_bad_isa_values_fail_with_one_line(monkeypatch):
    monkeypatch.delenv(_loader.ISA_ENV_ALIAS, raising=False)
    monkeypatch.setenv(_loader.ISA_ENV, "avx3")
    with pytest.raises(ValueError, match=r"^MEGATRON_LIKE_ISA='avx3' is not a kernel path: set it to avx512"):
        _loader.forced_isa()
    monkeypatch.setenv(_loader.ISA_ENV, "avx2")
    monkeypatch.setenv(_loader.ISA_ENV_ALIAS, "AVX2")
    assert _loader.forced_isa() == "avx2"
    monkeypatch.setenv(_loader.ISA_ENV_ALIAS, "scalar")
    with pytest.raises(ValueError, match="disagree: set only MEGATRON_LIKE_ISA"):
        _loader.forced_isa()
    with pytest.raises(RuntimeError, match=r"^MEGATRON_LIKE_ISA=avx512 asks for the avx512 kernels, but this "
                                           r"CPU's widest path is avx2: unset MEGATRON_LIKE_ISA or set it to one "
                                           r"of scalar, avx2$"):
        _loader.check_isa_supported("avx512", "avx2")
    _loader.check_isa_supported("avx2", "avx512")
    done = run_sourced(_loader.ISA_ENV, "avx3", "print('python ran')")
    assert done.returncode != 0 and "python ran" not in done.stdout
    assert done.stderr.strip().splitlines() == [
        "MEGATRON_LIKE_ISA=avx3 is not a kernel path: set it to avx512, avx2 or scalar, or unset it"]
