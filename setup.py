"""Build script for the compiled kernels; metadata lives in pyproject.toml.

Every ``csrc/<name>.cpp`` becomes its own pybind11 extension ``megatron_like._csrc.<name>`` (the
source must say ``PYBIND11_MODULE(<name>, m)``). The sources include no torch headers, so the build
needs only a C++17 compiler and pybind11, and takes seconds, not the apex-style half hour.

- Extensions compile in parallel, one per core.
- Each extension is optional: a missing compiler or a failing source prints a warning and the install
  goes on; at run time ``megatron_like.kernels`` warns once and uses its PyTorch fallbacks.
- Vector code is chosen at run time inside the kernels (AVX-512 / AVX2 / baseline), so nothing is
  compiled with ``-march=native`` and the build is portable to any x86-64 machine.
- ``csrc/cuda/*.cu`` become ``megatron_like._csrc.cuda_<name>`` only when ``nvcc`` exists and the
  installed torch is a CUDA build (``MEGATRON_LIKE_BUILD_CUDA=1`` forces them, ``0`` skips them);
  ``MEGATRON_LIKE_CUDA_ARCH`` is nvcc's ``-arch`` (e.g. ``native``, which ``scripts/gpu_check.sh`` uses).
- pybind11's headers come from the pybind11 package, else from the copy inside torch.
- ``MEGATRON_LIKE_SKIP_CSRC=1`` skips all compiled code (pure-PyTorch install).
"""

from __future__ import annotations

import glob
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
CSRC = "csrc"

CXX_FLAGS = [
    "-O3",
    "-std=c++17",
    # Vectorizing the kernels' selects and sqrt needs these; unlike -ffast-math they keep inf/NaN
    # semantics, which the masked softmax relies on.
    "-fno-math-errno",
    "-fno-trapping-math",
    # 512-bit vector arguments between inlined helpers trip a harmless ABI note on GCC.
    "-Wno-psabi",
]
OPENMP_FLAG = "-fopenmp"


def _env_flag(name: str) -> bool | None:
    """Return True/False for an explicit 1/0 environment flag, None when unset."""
    value = os.environ.get(name, "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    return None


def pybind11_include() -> str | None:
    """Return pybind11's header directory: the pybind11 package's, else the copy torch ships, else None.

    The copy in torch lets a machine whose python has torch but no pybind11 and no network (a lent GPU machine,
    scripts/gpu_check.sh) build the kernels; torch is located without importing it.
    """
    try:
        import pybind11
    except ImportError:
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.origin is None:
            return None
        include = Path(spec.origin).parent / "include"
        return str(include) if (include / "pybind11" / "pybind11.h").exists() else None
    return pybind11.get_include()


def cpu_extensions() -> list[Extension]:
    """Return one optional extension per ``csrc/*.cpp``."""
    pybind11_dir = pybind11_include()
    if pybind11_dir is None:  # the build requirement is missing: install without kernels
        print("megatron_like: pybind11 not found; skipping compiled kernels", file=sys.stderr)
        return []
    extensions = []
    for source in sorted(glob.glob(f"{CSRC}/*.cpp")):
        name = Path(source).stem
        extensions.append(
            Extension(
                f"megatron_like._csrc.{name}",
                sources=[source],
                include_dirs=[CSRC, pybind11_dir],
                depends=sorted(glob.glob(f"{CSRC}/*.h")),
                language="c++",
                optional=True,
            )
        )
    return extensions


def cuda_sources() -> list[str]:
    """Return the ``.cu`` files to build: only with nvcc and a CUDA torch (or when forced)."""
    forced = _env_flag("MEGATRON_LIKE_BUILD_CUDA")
    if forced is False or shutil.which("nvcc") is None:
        return []
    if forced is None:
        try:
            import torch
        except ImportError:
            return []
        if torch.version.cuda is None:
            return []
    return sorted(glob.glob(f"{CSRC}/cuda/*.cu"))


class BuildCsrc(build_ext):
    """build_ext that compiles extensions in parallel and never fails the install."""

    def finalize_options(self) -> None:
        super().finalize_options()
        if self.parallel is None:
            self.parallel = os.cpu_count() or 1

    def build_extensions(self) -> None:
        compiler = self.compiler
        # pybind11 modules: hidden visibility keeps them small; no debug info keeps the build fast.
        flags = [*CXX_FLAGS, "-fvisibility=hidden", "-g0"]
        link = []
        if _compiler_accepts(compiler, OPENMP_FLAG):
            flags.append(OPENMP_FLAG)
            link.append(OPENMP_FLAG)
        else:
            self.warn("compiler lacks OpenMP: kernels will run on one thread")
        for ext in self.extensions:
            ext.extra_compile_args = [*flags, *ext.extra_compile_args]
            ext.extra_link_args = [*link, *ext.extra_link_args]
        super().build_extensions()
        self.cuda_modules = [name for name in map(self._build_cuda, cuda_sources()) if name is not None]

    def copy_extensions_to_source(self) -> None:
        """``--inplace`` and ``pip install -e``: copy the CUDA twins into the source tree with the CPU modules.

        setuptools builds in ``build_lib`` and copies only the extensions it knows (the CPU ones): without this
        an editable install would leave the CUDA twins where no import finds them.
        """
        super().copy_extensions_to_source()
        build_py = self.get_finalized_command("build_py")
        for name in getattr(self, "cuda_modules", []):
            filename = self.get_ext_filename(name)
            package_dir = build_py.get_package_dir(name.rpartition(".")[0])
            self.copy_file(os.path.join(self.build_lib, filename), os.path.join(package_dir, Path(filename).name))

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as error:  # noqa: BLE001 - any failure must leave the install usable
            self.warn(f"megatron_like: could not build {ext.name} ({error}); its PyTorch fallback will be used")

    def _build_cuda(self, source: str) -> str | None:
        """Compile one .cu file with nvcc into ``megatron_like._csrc.cuda_<name>``; return that name (None: failed)."""
        name = f"cuda_{Path(source).stem}"
        module = f"megatron_like._csrc.{name}"
        ext_path = Path(self.get_ext_fullpath(module))
        ext_path.parent.mkdir(parents=True, exist_ok=True)
        include = [
            f"-I{CSRC}",
            f"-I{CSRC}/cuda",
            f"-I{pybind11_include()}",
            f"-I{sysconfig.get_paths()['include']}",
        ]
        # MEGATRON_LIKE_CUDA_ARCH=native (or sm_90, ...) compiles for that GPU; by default nvcc's own default
        # architecture, whose PTX the driver compiles for newer GPUs at the first load.
        arch = os.environ.get("MEGATRON_LIKE_CUDA_ARCH", "").strip()
        cmd = [
            "nvcc",
            "-O3",
            "-std=c++17",
            *([f"-arch={arch}"] if arch else []),
            "--shared",
            "-Xcompiler",
            "-fPIC,-fvisibility=hidden",
            "-DML_CUDA_PYBIND=1",
            f"-DML_CUDA_MODULE={name}",
            *include,
            source,
            "-o",
            str(ext_path),
        ]
        try:
            subprocess.run(cmd, check=True)
        except (OSError, subprocess.CalledProcessError) as error:
            self.warn(f"megatron_like: could not build {name} with nvcc ({error})")
            return None
        return module


def _compiler_accepts(compiler, flag: str) -> bool:
    """Return whether the C++ compiler accepts ``flag`` (compiles a tiny file with it)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp, "flag_check.cpp")
        source.write_text("int main() { return 0; }\n")
        try:
            compiler.compile([str(source)], output_dir=tmp, extra_postargs=[flag])
        except Exception:  # noqa: BLE001 - unknown flag or no compiler at all
            return False
    return True


if _env_flag("MEGATRON_LIKE_SKIP_CSRC"):
    EXTENSIONS: list[Extension] = []
else:
    EXTENSIONS = cpu_extensions()

setup(ext_modules=EXTENSIONS, cmdclass={"build_ext": BuildCsrc})
