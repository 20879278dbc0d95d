"""The fp16 loss scaler's skip/backoff/growth rule (Megatron's DynamicGradScaler) and flag validation."""

from __future__ import annotations

import pytest

from megatron_like.config import ConfigError, parse_config
from megatron_like.optimizer import DynamicLossScaler, LossScaler, build_loss_scaler
from megatron_like.training.loop import check_supported


def test_backoff_waits_for_hysteresis_and_respects_the_minimum() -> None:
    scaler = DynamicLossScaler(initial_scale=8.0, min_scale=2.0, window=100, hysteresis=2)
    scaler.update(found_inf=True)
    assert scaler.scale == 8.0  # first overflow spends hysteresis
    scaler.update(found_inf=True)
    assert scaler.scale == 4.0
    scaler.update(found_inf=True)  # the budget stays spent until the next growth
    assert scaler.scale == 2.0
    scaler.update(found_inf=True)
    assert scaler.scale == 2.0  # never below --min-loss-scale


def test_growth_after_a_clean_window_restores_hysteresis() -> None:
    scaler = DynamicLossScaler(initial_scale=4.0, min_scale=1.0, window=3, hysteresis=2)
    scaler.update(found_inf=True)
    assert scaler.scale == 4.0
    for _ in range(2):
        scaler.update(found_inf=False)
    assert scaler.scale == 4.0
    scaler.update(found_inf=False)
    assert scaler.scale == 8.0
    scaler.update(found_inf=True)  # hysteresis is back to 2: one overflow does not back off
    assert scaler.scale == 8.0
    scaler.update(found_inf=False)  # an overflow resets the clean-iteration count
    scaler.update(found_inf=False)
    assert scaler.scale == 8.0
    scaler.update(found_inf=False)
    assert scaler.scale == 16.0


def test_state_round_trip_and_constant_scale() -> None:
    scaler = DynamicLossScaler(initial_scale=64.0, window=5, hysteresis=3)
    scaler.update(found_inf=True)
    scaler.update(found_inf=False)
    copy = DynamicLossScaler(initial_scale=1.0, window=5, hysteresis=3)
    copy.load_state_dict(scaler.state_dict())
    assert (copy.scale, copy.growth_tracker, copy.hysteresis_tracker) == (64.0, 1, 2)
    constant = LossScaler(128.0)
    constant.update(found_inf=True)
    assert constant.scale == 128.0


def _config(*flags: str):
    return parse_config(["--mock-data", "--vocab-size", "64", *flags], world_size=1)


def test_build_loss_scaler_from_flags() -> None:
    assert build_loss_scaler(_config().precision) is None
    assert build_loss_scaler(_config("--bf16").precision) is None
    static = build_loss_scaler(_config("--fp16", "--loss-scale", "512").precision)
    assert type(static) is LossScaler and static.scale == 512.0
    dynamic = build_loss_scaler(_config("--fp16", "--initial-loss-scale", "1024", "--hysteresis", "1").precision)
    assert isinstance(dynamic, DynamicLossScaler) and dynamic.scale == 1024.0 and dynamic.hysteresis == 1


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--bf16", "--loss-scale", "128"], "--loss-scale 128.0 only applies with --fp16"),
        (["--fp16", "--initial-loss-scale", "1", "--min-loss-scale", "4"], "--initial-loss-scale 1.0 is below"),
        (["--num-layers", "4", "--recompute-granularity", "full", "--recompute-method", "block",
          "--recompute-num-layers", "5"], "--recompute-num-layers 5 exceeds the 4 layers"),
    ],
)
def test_invalid_combinations_are_one_line_errors(flags: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("-", r"\-").replace(".", r"\.")) as error:
        check_supported(_config(*flags))
    assert "\n" not in str(error.value)
