"""The CUDA twins in csrc/cuda compile with nvcc (no GPU needed; skipped without nvcc).

Their numerics are the CPU kernels' contract, which test_kernels_* check; this guards the sources
against rot on machines that cannot run them.
"""

from __future__ import annotations

import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

from tests.subprocesses import run_at_once

ROOT = Path(__file__).resolve().parents[2]
CUDA_DIR = ROOT / "csrc" / "cuda"
SOURCES = sorted(CUDA_DIR.glob("*.cu"))
NVCC = shutil.which("nvcc")

pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")


def nvcc_command(source: Path, out_dir: Path, extra: list[str]) -> list[str]:
    return [NVCC, "-c", "-std=c++17", "-arch=sm_80", f"-I{CUDA_DIR}", *extra, str(source), "-o",
            str(out_dir / f"{source.stem}.o")]


def kernels_command(out_dir: Path) -> list[str]:
    # One translation unit that includes every source (by absolute path, so errors name the file and line): nvcc
    # parses the CUDA headers once instead of once per file (~5 s of CPU instead of ~17 s for the seven files).
    # Every kernel is still compiled for sm_80 with warnings as errors; what one unit cannot see is a file that
    # forgets an #include an earlier file brings in (setup.py's per-file build on a CUDA machine would).
    combined = out_dir / "all_kernels.cu"
    combined.write_text("".join(f'#include "{source}"\n' for source in SOURCES))
    return nvcc_command(combined, out_dir, ["-Werror", "all-warnings"])


def glue_command(out_dir: Path) -> list[str]:
    """layer_norm.cu with its pybind11 module, as setup.py builds each twin on a CUDA machine."""
    import pybind11  # a build requirement (pyproject.toml): missing is a broken setup, not a skip

    return nvcc_command(CUDA_DIR / "layer_norm.cu", out_dir, [
        "-Xcompiler", "-fPIC", "-DML_CUDA_PYBIND=1", "-DML_CUDA_MODULE=cuda_layer_norm",
        f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}"])


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """Both nvcc builds of the tests below, started at once (one core each, ~4 s and ~10 s of CPU, nothing
    shared): ``{name: (the finished process, its output directory)}``."""
    out_dirs = {name: tmp_path_factory.mktemp(name) for name in ("kernels", "glue")}
    done = run_at_once({"kernels": {"args": kernels_command(out_dirs["kernels"])},
                        "glue": {"args": glue_command(out_dirs["glue"])}})
    return {name: (result, out_dirs[name]) for name, result in done.items()}


def test_expected_cuda_sources_exist():
    names = {p.stem for p in SOURCES}
    assert {"scaled_masked_softmax", "scaled_upper_triang_masked_softmax", "layer_norm", "rms_norm", "swiglu",
            "rotary", "grouped_gemm"} <= names


def test_cuda_sources_compile(builds):
    result, out_dir = builds["kernels"]
    assert result.returncode == 0, f"nvcc failed:\n{result.stderr}"
    assert (out_dir / "all_kernels.o").stat().st_size > 0


@pytest.mark.slow
def test_cuda_pybind_glue_compiles(builds):
    result, _ = builds["glue"]
    assert result.returncode == 0, result.stderr
