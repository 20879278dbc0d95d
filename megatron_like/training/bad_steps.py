"""Bad steps: caught before they reach the weights, rerun to tell a bad batch from a flipped bit.

A step is *bad* when, on any rank, its loss or its gradient norm is not finite
(``--check-for-nan-in-loss-and-grad``, on by default) or, with ``--rerun-mode validate_results``, its loss is above
``--loss-spike-factor`` x the running mean of the last good steps' losses. Every rank's verdict rides on the
reductions the optimizer makes anyway (``DistributedOptimizer.step(suspicious=...)``), so all ranks agree, and a
bad step applies nothing, as Megatron-LM skips an fp16 overflow: the weights, the Adam moments and step count and
the lr schedule stay as they were; the iteration counter and the consumed samples move on (the batch was used).

``--rerun-mode validate_results`` then runs the step again from the same state: the generators are put back and
the same micro batches are replayed (:class:`ReplayableIterator`; the weights have not moved). Its verdict:

* bad again: a reproducible fault of the data or the model. The step stays skipped and rank 0 logs the global
  batch by its sample indices. After ``--max-skipped-steps`` bad steps in a row the run saves (with ``--save``)
  and exits with :data:`EXIT_VALIDATION_FAILED` (17, Megatron-LM's ``EXIT_CODE_FAILED_ON_RESULT_VALIDATION``).
* clean: a transient fault (a flipped bit, a flaky device). The clean rerun's update is kept, the run saves after
  this iteration and exits with :data:`EXIT_TRANSIENT_FAULT` (16, Megatron-LM's
  ``EXIT_CODE_RESUME_TO_DISAMBIGUATE``) so that the launcher restarts it, on other hardware if it can.

Megatron-LM compares the rerun's values with the first run's; here the rerun is judged by the same rules as the
first run, which also holds where a rerun is not bitwise (atomics in GPU kernels). A fault that reproduces on the
same device is taken for the data's: a device that fails the same way twice is a limit of a rerun in place.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch

from megatron_like.config import Config
from megatron_like.parallel_state import ParallelState
from megatron_like.training.checkpointing import rng_state, set_rng_state

EXIT_TRANSIENT_FAULT = 16
"""A bad step whose rerun was clean: restart the job (elsewhere if possible); it resumes where it stopped."""
EXIT_VALIDATION_FAILED = 17
"""--max-skipped-steps bad steps in a row, each reproduced: fix the data or the model before restarting."""
SPIKE_WINDOW = 20
"""Good steps whose losses make the running mean that a spike is measured against."""


class ReplayableIterator:
    """An iterator that remembers what it yielded since :meth:`start_step` and yields it again after :meth:`replay`.

    Holds one step's micro batches (this rank's share of one global batch): references to tensors the step
    reads anyway, no copy.
    """

    def __init__(self, iterator: Iterator) -> None:
        self.iterator = iterator
        self.recorded: list[Any] = []
        self.pending: deque[Any] = deque()

    def __iter__(self) -> ReplayableIterator:
        return self

    def __next__(self) -> Any:
        if self.pending:
            return self.pending.popleft()
        item = next(self.iterator)
        self.recorded.append(item)
        return item

    def start_step(self) -> None:
        """Forget the previous step's items."""
        self.recorded, self.pending = [], deque()

    def replay(self) -> None:
        """Yield this step's items again, in order, before drawing new ones."""
        self.pending = deque(self.recorded)


def step_losses(stats: list[dict[str, torch.Tensor]]) -> torch.Tensor | None:
    """This rank's loss statistics of one step stacked ``[micro batches x statistics]`` (None off the last stage)."""
    if not stats:
        return None
    return torch.stack([value.detach().float().reshape(()) for s in stats for value in s.values()])


class BadStepGuard:
    """Judges each step on this rank, reruns bad ones (``--rerun-mode validate_results``), counts skips in a row."""

    def __init__(self, config: Config, ps: ParallelState, train_iterator: Iterator | None) -> None:
        r = config.resilience
        self.check_nan = r.check_for_nan_in_loss_and_grad
        self.rerun = r.rerun_mode == "validate_results"
        self.spike_factor = r.loss_spike_factor
        self.max_skipped = r.max_skipped_steps
        self.ps = ps
        self.global_batch_size = config.global_batch_size
        self.iterator = ReplayableIterator(train_iterator) if self.rerun and train_iterator is not None \
            else train_iterator
        self.good_losses: deque[float] = deque(maxlen=SPIKE_WINDOW)
        self.skipped_in_a_row = 0

    def suspicious(self, stats: list[dict[str, torch.Tensor]]) -> bool:
        """This rank's verdict on its own losses of the step: not finite, or (rerun mode) a spike."""
        if not (self.check_nan or self.rerun):
            return False
        losses = step_losses(stats)
        if losses is None:
            return False
        if self.check_nan and not bool(torch.isfinite(losses).all()):
            return True
        if self.rerun and self.good_losses:
            mean = sum(self.good_losses) / len(self.good_losses)
            main = torch.stack([s.get("lm loss", s.get("loss", torch.zeros(()))).detach().float() for s in stats])
            return bool(main.mean() > self.spike_factor * mean)
        return False

    def run(self, step: Callable[[Any], Any], iteration: int, consumed_samples: int) -> tuple[Any, int]:
        """Run ``step(data_iterator)`` (a ``StepOutput``) as iteration ``iteration``; return its output and the exit
        status the run must save and leave with (0: go on).

        ``step`` must apply nothing when its output is ``bad`` (all ranks agree on it); in rerun mode it runs a
        second time from the same generators and micro batches.
        """
        snapshot = rng_state() if self.rerun else None
        if isinstance(self.iterator, ReplayableIterator):
            self.iterator.start_step()
        output = step(self.iterator)
        if not output.bad:
            self._good(output)
            return output, 0
        how = ""
        if self.rerun:
            set_rng_state(snapshot)
            if isinstance(self.iterator, ReplayableIterator):
                self.iterator.replay()
            rerun = step(self.iterator)
            if not rerun.bad:
                self._print(f" > WARNING: iteration {iteration} was bad ({_describe(output)}) and its rerun clean "
                            f"({_describe(rerun)}): a transient fault; saving and exiting with status "
                            f"{EXIT_TRANSIENT_FAULT} for a restart")
                self._good(rerun)
                return rerun, EXIT_TRANSIENT_FAULT
            how = " reproduced by its rerun;"
            output = rerun
        self.skipped_in_a_row += 1
        samples = f"[{consumed_samples}, {consumed_samples + self.global_batch_size})"
        self._print(f" > WARNING: skipped iteration {iteration}: {_describe(output)},{how} samples {samples} of the "
                    f"global batch ({self.skipped_in_a_row} in a row)")
        if self.skipped_in_a_row >= self.max_skipped:
            self._print(f" > error: {self.skipped_in_a_row} bad iterations in a row (--max-skipped-steps "
                        f"{self.max_skipped}): saving and exiting with status {EXIT_VALIDATION_FAILED}; look at the "
                        "data of the logged samples, or lower the learning rate")
            return output, EXIT_VALIDATION_FAILED
        return output, 0

    def _good(self, output: Any) -> None:
        self.skipped_in_a_row = 0
        loss = output.losses.get("lm loss", output.losses.get("loss"))
        if loss is not None and math.isfinite(loss):
            self.good_losses.append(loss)

    def _print(self, message: str) -> None:
        if self.ps.rank == 0:
            print(message, flush=True)


def _describe(output: Any) -> str:
    """``loss nan, grad norm nan`` of a step (the loss as every rank knows it only after the step: may be absent)."""
    loss = output.losses.get("lm loss", output.losses.get("loss"))
    norm = "none" if output.grad_norm is None else f"{output.grad_norm:.4g}"
    return (f"loss {loss:.4g}, " if loss is not None else "") + f"grad norm {norm}"
