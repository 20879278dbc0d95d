"""The CUDA twins in csrc/cuda compile with nvcc (no GPU needed; skipped without nvcc).

Their numerics are the CPU kernels' contract, which test_kernels_* check; this guards the sources
against rot on machines that cannot run them.
"""

from __future__ import annotations

import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CUDA_DIR = ROOT / "csrc" / "cuda"
SOURCES = sorted(CUDA_DIR.glob("*.cu"))
NVCC = shutil.which("nvcc")

pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")


def nvcc_compile(source: Path, out_dir: Path, extra: list[str]) -> subprocess.CompletedProcess:
    cmd = [
        NVCC,
        "-c",
        "-std=c++17",
        "-arch=sm_80",
        f"-I{CUDA_DIR}",
        *extra,
        str(source),
        "-o",
        str(out_dir / f"{source.stem}.o"),
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_expected_cuda_sources_exist():
    names = {p.stem for p in SOURCES}
    assert {"scaled_masked_softmax", "scaled_upper_triang_masked_softmax", "layer_norm", "rms_norm", "swiglu",
            "rotary", "grouped_gemm"} <= names


def test_cuda_sources_compile(tmp_path):
    # The files are independent: compile them concurrently to keep the test short.
    with ThreadPoolExecutor(max_workers=len(SOURCES)) as pool:
        results = list(pool.map(lambda s: nvcc_compile(s, tmp_path, ["-Werror", "all-warnings"]), SOURCES))
    for source, result in zip(SOURCES, results):
        assert result.returncode == 0, f"nvcc failed on {source.name}:\n{result.stderr}"
        assert (tmp_path / f"{source.stem}.o").stat().st_size > 0


@pytest.mark.slow
def test_cuda_pybind_glue_compiles(tmp_path):
    pybind11 = pytest.importorskip("pybind11")
    source = CUDA_DIR / "layer_norm.cu"
    extra = [
        "-Xcompiler",
        "-fPIC",
        "-DML_CUDA_PYBIND=1",
        "-DML_CUDA_MODULE=cuda_layer_norm",
        f"-I{pybind11.get_include()}",
        f"-I{sysconfig.get_paths()['include']}",
    ]
    result = nvcc_compile(source, tmp_path, extra)
    assert result.returncode == 0, result.stderr
