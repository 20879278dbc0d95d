"""ResilienceConfig: bad steps (checks, reruns, skips), slow ranks, and the fault-injection test tool."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from megatron_like.config.fields import POSITIVE, REPEATABLE, Range, Requires


@dataclass
class ResilienceConfig:
    """Bad steps caught before they reach the weights, slow ranks named, faults injected on purpose."""

    check_for_nan_in_loss_and_grad: bool = True
    """Check the loss and the gradient norm on every rank before the optimizer step (all ranks agree); a NaN or
    Inf skips the update as an fp16 overflow does: weights, Adam moments and step, lr schedule unchanged
    (--no-check-for-nan-in-loss-and-grad: step anyway, Megatron's flag)."""
    rerun_mode: Literal["disabled", "validate_results"] = "disabled"
    """validate_results: rerun a step whose loss or gradient norm is not finite, or whose loss jumps above
    --loss-spike-factor x its running mean, from the same state and batch; the same result twice skips the step
    (a bad batch or model), a different one saves and exits with status 16 (a transient fault: restart elsewhere).
    docs/checkpoints.md "Preemption and faults"."""
    loss_spike_factor: Annotated[float, Range(min=1, min_open=True), Requires("rerun_mode", "validate_results")] = 10.0
    """A loss above this factor x the running mean of the last good steps' losses is a spike (rerun)."""
    max_skipped_steps: Annotated[int, POSITIVE] = 5
    """After this many bad steps in a row the run saves (with --save) and exits with status 17 (validation failed:
    fix the data or the model before restarting)."""
    log_straggler: bool = False
    """Every log interval, gather each rank's step compute time and print min / median / max with the slowest
    ranks and their hosts (one small all-gather per log interval)."""
    straggler_threshold: Annotated[float, Range(min=1, min_open=True), Requires("log_straggler")] = 1.5
    """Warn when a rank's compute time is above this factor x the median rank's."""
    inject_fault: Annotated[list[str], REPEATABLE] = field(default_factory=list)
    """Test tool, off by default, never for production runs: KIND@ITER[:RANK] makes the run fail on purpose
    (repeatable); KIND is nan_loss, nan_grad, transient, loss_spike, slow, hang, dead, save_fail or slow_save
    (training/fault_injection.py), e.g. dead@3:1 kills rank 1 at iteration 3."""

    def validate(self) -> None:
        """Nothing between fields: --inject-fault is parsed by the trainer's checks (training/fault_injection.py,
        before any process group), where its kinds are defined."""
