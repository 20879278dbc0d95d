"""``benchmarks/learning_quality.py`` reuses a finished run's log only when the same command made it."""

from __future__ import annotations

import sys

from benchmarks.learning_quality import run


def test_a_log_is_reused_only_for_the_command_that_made_it(tmp_path, capsys):
    log = tmp_path / "run.log"
    first = [sys.executable, "-c", "print('seed 1')"]
    assert run(first, log).strip() == "seed 1"
    assert run(first, log).strip() == "seed 1"
    assert f"reusing {log}" in capsys.readouterr().out
    # the same file name, other flags: trained again, not the old result
    assert run([sys.executable, "-c", "print('seed 2')"], log).strip() == "seed 2"
    assert "made by another command" in capsys.readouterr().out
    assert run(first, log, rerun=True).strip() == "seed 1"
