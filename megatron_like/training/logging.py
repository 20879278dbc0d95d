"""Where training metrics go: the Megatron log line on stdout, TensorBoard scalars and (optionally) wandb.

The last rank reports (it holds the loss, being on the last pipeline stage), as in Megatron. TensorBoard
tags follow Megatron's names so existing dashboards keep working::

    lm loss, learning-rate, grad-norm, loss-scale, throughput (tokens/s), tflops (per device),
    mem-max-gib, lm loss validation, lm loss validation ppl, lm loss test, lm loss test ppl

``tools/plot_logs.py`` draws the same curves from a log file or from the TensorBoard directory.
"""

from __future__ import annotations

import math
import resource
import sys
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
        self.reporting = ps.rank == ps.world_size - 1
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
        memory = max_memory_gib(self.ps.device) if self.config.logging.log_memory else None
        if not self.reporting:
            return
        line = format_log_line(
            iteration=iteration, train_iters=self.config.training.train_iters, consumed_samples=consumed_samples,
            elapsed_ms=elapsed_ms, tokens_per_second=tokens_per_second, tflops_per_device=tflops_per_device,
            learning_rate=learning_rate, global_batch_size=self.config.global_batch_size, losses=losses,
            loss_scale=loss_scale, grad_norm=grad_norm, skipped_iterations=skipped_iterations,
            nan_iterations=nan_iterations,
        )
        if memory is not None:
            line += f" max memory (GiB): {memory:.3f} |"
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
