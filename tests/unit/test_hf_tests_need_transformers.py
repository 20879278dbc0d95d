"""transformers is a test dependency (pyproject's ``test`` extra): without it the Hugging Face comparison tests must
fail, not skip, or a broken test environment would pass the suite having checked no conversion at all."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Every test that compares with transformers: whole modules, and the tests of other modules that need it.
HF_MODULES = ["tests/unit/test_hf_llama.py", "tests/unit/test_hf_mixtral.py", "tests/unit/test_generation.py",
              "tests/e2e/test_tools_inference.py", "tests/e2e/test_hf_llama_cli.py"]
HF_TESTS = ["tests/unit/test_llama_model.py::test_kv_cache_decoding_equals_full_forward",
            "tests/unit/test_data_tokenizer.py::test_fast_equals_transformers_slow_tokenizer"]


def test_hf_tests_fail_without_transformers(tmp_path):
    # A `transformers` package first on the path that raises what a missing one raises (importorskip skips on
    # ModuleNotFoundError only).
    (tmp_path / "transformers").mkdir()
    (tmp_path / "transformers" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'transformers'\", name='transformers')\n")
    python_path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", "--continue-on-collection-errors",
         "-o", "addopts=", *HF_MODULES, *HF_TESTS],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": python_path},
    )
    summary = [line for line in proc.stdout.splitlines() if line.startswith(("ERROR", "FAILED", "SKIPPED"))]
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert not [line for line in summary if line.startswith("SKIPPED")], summary
    for target in HF_MODULES + HF_TESTS:
        assert any(line.split()[1].startswith(target) for line in summary), (target, proc.stdout[-3000:])



def test_no_test_skips_itself_when_transformers_is_missing():
    needle = "importorskip(" + '"transformers")'  # split: this file is no offender
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("*.py") if needle in p.read_text()]
    assert offenders == [], f"{offenders}: import transformers instead (a test dependency; missing, tests fail)"
