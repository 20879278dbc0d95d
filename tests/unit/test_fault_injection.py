"""``--inject-fault KIND@ITER[:RANK]``: repeatable, checked before anything starts, due only where and when named."""

from __future__ import annotations

import pytest

from megatron_like.config import ConfigError, parse_config
from megatron_like.training.fault_injection import FaultSpec, install_faults, parse_fault, should_inject
from tests.distributed.gpt_runs import BASE_FLAGS


def test_faults_accumulate_parse_and_fire_only_where_and_when_named(monkeypatch):
    config = parse_config(BASE_FLAGS + ["--inject-fault", "dead@3:1", "--inject-fault", "save_fail@2"], world_size=2)
    specs = [parse_fault(text) for text in config.training.inject_fault]
    assert specs == [FaultSpec("dead", 3, 1), FaultSpec("save_fail", 2, None)]
    install_faults(specs)
    try:
        assert should_inject("dead", 3, 1) and not should_inject("dead", 3, 0) and not should_inject("dead", 2, 1)
        assert should_inject("save_fail", 2, 0) and should_inject("save_fail", 2, 1)
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a restarted worker gets past a kill
        assert not should_inject("dead", 3, 1) and should_inject("save_fail", 2, 1)
    finally:
        install_faults([])
    for bad in ("dead", "dead@x", "explode@3", "hang@3:r"):
        with pytest.raises(ConfigError, match=f"--inject-fault {bad} is not KIND@ITER"):
            parse_config(BASE_FLAGS + ["--inject-fault", bad], world_size=1)
