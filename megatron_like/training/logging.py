"""Where training metrics go: the Megatron log line on stdout, TensorBoard scalars and (optionally) wandb.

The last rank reports (it holds the loss, being on the last pipeline stage), as in Megatron. TensorBoard
tags follow Megatron's names so existing dashboards keep working::

    lm loss, learning-rate, grad-norm, loss-scale, throughput (tokens/s), tflops (per device),
    mem-max-gib, lm loss validation, lm loss validation ppl, lm loss test, lm loss test ppl

``tools/plot_logs.py`` draws the same curves from a log file or from the TensorBoard directory.
"""

from __future__ import annotations

import contextlib
import math
import resource
import sys
from collections.abc import Iterator
from typing import Any

import torch

from megatron_like.config import Config
from megatron_like.parallel_state import ParallelState
from megatron_like.training.metrics import format_log_line


def max_memory_gib(device: torch.device) -> float:
    """Peak memory of this process: allocated device memory on CUDA, the peak resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / (2**30 if sys.platform == "darwin" else 2**20)


def persistent_bytes(model: list[torch.nn.Module], optimizer: Any) -> int:
    """Bytes a training run holds between steps: parameter and gradient buffers, optimizer state, module buffers."""
    from megatron_like.distributed.memory import measured_state_bytes

    persistent = measured_state_bytes(optimizer.data_parallel, optimizer).total
    return persistent + sum(b.untyped_storage().nbytes() for chunk in model for b in chunk.buffers())


class CPUStepMemory:
    """Peak bytes of live CPU tensors during the training steps it watches (the CPU log figure).

    The resident set is no measure of what training holds: glibc keeps freed memory mapped and grows its
    mmap threshold, so it read higher at ZeRO-3 than at ZeRO-2. Instead, during a watched step the
    profiler's allocation log (every allocation and free of torch's CPU allocator, signed bytes in order)
    is kept, and the step's peak is ``persistent + max over the log of the running sum``, where
    ``persistent`` is what the run holds between steps: parameter and gradient buffers, optimizer state
    and module buffers. Tensors allocated before the step and freed during it (the previous step's batch)
    are not in the log: their frees are not subtracted, which errs high by a batch at most; torch may
    print once that such a free was not recorded.

    Only some of the steps that get a log line are watched (``TrainingLogger.watch_step``): the profiler
    costs time while it runs (``docs/training.md`` gives the figure). It uses torch's legacy profiler, which
    records on this thread and prints nothing; backward on CPU runs on this thread too.
    """

    def __init__(self) -> None:
        self.max_bytes = 0

    @contextlib.contextmanager
    def watch(self, model: list[torch.nn.Module], optimizer: Any) -> Iterator[None]:
        """Record the allocations of the block (one training step) and fold its peak into ``max_bytes``."""
        from torch._C._autograd import _disable_profiler_legacy, _enable_profiler_legacy
        from torch._C._profiler import ProfilerConfig, ProfilerState, _ExperimentalConfig

        persistent = persistent_bytes(model, optimizer)
        # (state, report_input_shapes, profile_memory, with_stack, with_flops, with_modules, experimental)
        _enable_profiler_legacy(ProfilerConfig(ProfilerState.CPU, False, True, False, False, False,
                                               _ExperimentalConfig()))
        try:
            yield
        finally:
            events = _disable_profiler_legacy()
        allocations = sorted((e.start_us(), e.cpu_memory_usage()) for thread in events for e in thread
                             if e.kind() == "memory_alloc")
        alive = peak = 0
        for _, nbytes in allocations:
            alive += nbytes
            peak = max(peak, alive)
        self.max_bytes = max(self.max_bytes, persistent + peak)


def perplexity(loss: float) -> float:
    """``exp(loss)``, saturating at inf instead of overflowing."""
    return math.exp(loss) if loss < 700 else math.inf


def evaluation_line(where: str, stats: dict[str, float]) -> str:
    """`` validation loss at <where> | lm loss value: X | lm loss PPL: Y |``: every statistic, PPL of the LM loss."""
    parts = [f" validation loss at {where}"]
    for name, value in stats.items():
        parts.append(f"{name} value: {value:.6E}")
        if name == "lm loss":  # a perplexity means something for language modeling only
            parts.append(f"{name} PPL: {perplexity(value):.6E}")
    return " | ".join(parts) + " |"


class TrainingLogger:
    """Prints the log lines and writes the scalars of one run (only the last rank writes anything)."""

    def __init__(self, config: Config, ps: ParallelState) -> None:
        self.config, self.ps = config, ps
        self.reporting = ps.rank == ps.reporting_rank
        # CPU runs report the peak of live tensors (see CPUStepMemory); CUDA runs the allocator's peak.
        self.cpu_memory = CPUStepMemory() if ps.device.type == "cpu" and config.logging.log_memory else None
        self._logged_steps = 0
        self.writer: Any = None
        self.wandb: Any = None
        log = config.logging
        if not self.reporting:
            return
        if log.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=log.tensorboard_dir, max_queue=1000)
            self.writer.add_text("config", f"```\n{config.to_dict()}\n```", 0)
        if log.wandb_project:
            try:
                import wandb
            except ImportError as error:
                raise RuntimeError("--wandb-project needs the wandb package: pip install wandb") from error
            self.wandb = wandb.init(project=log.wandb_project, name=log.wandb_exp_name, config=config.to_dict(),
                                    dir=log.tensorboard_dir)

    def watch_step(self, iteration: int, model: list[torch.nn.Module],
                   optimizer: Any) -> contextlib.AbstractContextManager:
        """Wrap training step ``iteration``: on CPU, the reporting rank measures some of the steps it logs.

        The profiler slows a watched step (twice as slow for a model of tiny ops, ~5% for real ones), so
        only the first two logged steps (the first allocates the optimizer state, the second is steady
        state) and then every tenth one are watched; the log repeats the peak measured so far.
        """
        if self.cpu_memory is None or not self.reporting or iteration % self.config.logging.log_interval:
            return contextlib.nullcontext()
        self._logged_steps += 1
        if self._logged_steps > 2 and self._logged_steps % 10:
            return contextlib.nullcontext()
        if torch._C._autograd._profiler_enabled():  # the user's profiler is running: leave it alone
            return contextlib.nullcontext()
        return self.cpu_memory.watch(model, optimizer)

    def _scalars(self, iteration: int, values: dict[str, float]) -> None:
        values = {k: v for k, v in values.items() if v is not None and math.isfinite(v)}
        if self.writer is not None:
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, iteration)
        if self.wandb is not None:
            self.wandb.log(values, step=iteration)

    def training(self, *, iteration: int, consumed_samples: int, elapsed_ms: float, tokens_per_second: float,
                 tflops_per_device: float, learning_rate: float, losses: dict[str, float], loss_scale: float,
                 grad_norm: float | None, skipped_iterations: int, nan_iterations: int) -> None:
        """Print the Megatron line of ``iteration`` (with the peak memory) and record its scalars."""
        if not self.reporting:
            return
        memory = None
        if self.cpu_memory is not None:
            if self.cpu_memory.max_bytes:  # 0 when no step could be watched
                memory, memory_label = self.cpu_memory.max_bytes / 2**30, "max live tensors (GiB)"
        elif self.config.logging.log_memory:
            memory, memory_label = max_memory_gib(self.ps.device), "max memory (GiB)"
        line = format_log_line(
            iteration=iteration, train_iters=self.config.training.train_iters, consumed_samples=consumed_samples,
            elapsed_ms=elapsed_ms, tokens_per_second=tokens_per_second, tflops_per_device=tflops_per_device,
            learning_rate=learning_rate, global_batch_size=self.config.global_batch_size, losses=losses,
            loss_scale=loss_scale, grad_norm=grad_norm, skipped_iterations=skipped_iterations,
            nan_iterations=nan_iterations,
        )
        if memory is not None:
            line += f" {memory_label}: {memory:.3f} |"
        print(line, flush=True)
        scalars = {name: value for name, value in losses.items()}
        scalars.update({"learning-rate": learning_rate, "grad-norm": grad_norm, "loss-scale": loss_scale,
                        "throughput": tokens_per_second, "tflops": tflops_per_device, "mem-max-gib": memory,
                        "consumed-samples": float(consumed_samples)})
        self._scalars(iteration, scalars)

    def evaluation(self, iteration: int, stats: dict[str, float], split: str = "validation") -> None:
        """Print Megatron's validation (or final test) line and record each statistic (and loss perplexity)."""
        if not self.reporting or not stats:
            return
        # Megatron's wording, also for the test split (log parsers look for it).
        where = f"iteration {iteration}" if split == "validation" else f"the end of training for {split} data"
        print(evaluation_line(where, stats), flush=True)
        scalars = {}
        for name, value in stats.items():
            scalars[f"{name} {split}"] = value
            if name.endswith("loss"):
                scalars[f"{name} {split} ppl"] = perplexity(value)
        self._scalars(iteration, scalars)

    def close(self) -> None:
        """Flush and close TensorBoard and wandb."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
