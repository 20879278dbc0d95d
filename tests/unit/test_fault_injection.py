"""The fault-injection harness (training/fault_injection.py): its flag, its parser and when each kind fires."""

from __future__ import annotations

import pytest

from megatron_like.config import ConfigError, parse_config
from megatron_like.training.fault_injection import FaultSpec, install_faults, parse_fault, should_inject

MOCK = ["--mock-data", "--vocab-size", "128"]


@pytest.fixture(autouse=True)
def no_faults_after():
    yield
    install_faults([])


def test_the_flag_repeats_and_parses():
    config = parse_config(MOCK + ["--inject-fault", "nan_loss@3", "--inject-fault", "nan_grad@2:1"])
    assert config.resilience.inject_fault == ["nan_loss@3", "nan_grad@2:1"]
    assert [parse_fault(t) for t in config.resilience.inject_fault] == [FaultSpec("nan_loss", 3),
                                                                        FaultSpec("nan_grad", 2, 1)]
    assert parse_config(MOCK).resilience.inject_fault == []


@pytest.mark.parametrize("text", ["boom@3", "nan_loss", "nan_loss@x", "nan_loss@0", "nan_loss@3:x", "@3"])
def test_a_malformed_fault_is_one_line_naming_the_flag(text):
    with pytest.raises(ConfigError) as refused:
        parse_fault(text)
    message = str(refused.value)
    assert message.startswith(f"--inject-fault {text!r}") and "\n" not in message, message


def test_each_kind_fires_where_its_rule_says(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert not should_inject("nan_loss", 3, 0)  # nothing installed: off
    install_faults(["nan_loss@3", "nan_grad@2:1", "transient@4", "slow@2:1"])
    assert [should_inject("nan_loss", i, r) for i in (2, 3, 3, 4) for r in (0, 1)] == [
        False, False, True, True, True, True, False, False]  # every rank, every execution of iteration 3
    assert [should_inject("nan_grad", 2, r) for r in (0, 1)] == [False, True]
    assert [should_inject("slow", i, 1) for i in (1, 2, 7)] == [False, True, True]
    assert not should_inject("slow", 7, 0)
    assert [should_inject("transient", 4, 0), should_inject("transient", 4, 0)] == [True, False]  # the rerun is clean
    install_faults(["transient@4"])
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert not should_inject("transient", 4, 0)  # a restarted job does not meet it again


def test_a_malformed_fault_stops_pretrain_gpt_in_one_line(capsys, monkeypatch):
    from tests.unit.test_input_errors import FLAGS, stderr_of_main

    code, err = stderr_of_main(FLAGS + ["--inject-fault", "nan@3"], capsys, monkeypatch)
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: --inject-fault 'nan@3' is not KIND@ITER"), err


def test_recovery_faults_fire_in_the_first_attempt_only_where_named(monkeypatch):
    """dead/hang kill or stop a rank once per job; save_fail fires at its iteration in every attempt."""
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    config = parse_config(MOCK + ["--inject-fault", "dead@3:1", "--inject-fault", "save_fail@2"], world_size=2)
    specs = [parse_fault(text) for text in config.resilience.inject_fault]
    assert specs == [FaultSpec("dead", 3, 1), FaultSpec("save_fail", 2, None)]
    install_faults(specs)
    assert not should_inject("dead", 3, 0) and not should_inject("dead", 2, 1) and should_inject("dead", 3, 1)
    assert should_inject("save_fail", 2, 0) and should_inject("save_fail", 2, 1)
    install_faults(specs)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a restarted worker gets past a kill
    assert not should_inject("dead", 3, 1) and should_inject("save_fail", 2, 1)
    for bad in ("dead", "dead@x", "explode@3", "hang@3:r"):
        with pytest.raises(ConfigError, match=f"--inject-fault '{bad}' is not KIND@ITER"):
            parse_fault(bad)
