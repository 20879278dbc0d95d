"""The training loop: ``pretrain()`` in Megatron's shape.

Order of one run: (flag and path checks) -> process groups -> glibc keeps freed memory (CPU,
``process_setup.py``) -> the lock of ``--save`` -> seeds -> model
chunks -> optimizer and schedule -> (validate the checkpoint on every rank, resume) ->
data iterators -> steps (forward/backward schedule, gradient reductions, every rank's bad-step verdict
(``bad_steps.py``), clipping, AdamW, lr) with the log line, evaluation and checkpoints at their intervals.
Data parallelism, ZeRO and the optimizer are applied in ``parallelize.py`` (its docstring gives the order of
every kind of parallelism).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from megatron_like import collectives as comm
from megatron_like.config import Config, ConfigError
from megatron_like.data.samplers import build_pretraining_data_loader
from megatron_like.distributed import gathered_parameters
from megatron_like.kernels import refresh_environment as refresh_kernel_environment
from megatron_like.model import chunk_layers
from megatron_like.model.moe import reduce_aux_losses, reset_aux_losses, set_aux_loss_backward_scale
from megatron_like.model.moe.expert_bias import routers_with_expert_bias, update_expert_biases
from megatron_like.optimizer import DistributedOptimizer
from megatron_like.parallel_state import ParallelState
from megatron_like.pipeline_parallel import get_forward_backward_func
from megatron_like.pipeline_parallel.placement import ChunkPlacement
from megatron_like.tensor_parallel import deferred_init, seed_everything
from megatron_like.training.bad_steps import BadStepGuard
from megatron_like.training.checkpoint_validation import validate_checkpoint
from megatron_like.training.checkpointing import latest_iteration, load_checkpoint, save_checkpoint
from megatron_like.training.fault_injection import (
    SLOW_SECONDS,
    SPIKE_FACTOR,
    install_faults,
    parse_fault,
    should_inject,
    step_faults,
)
from megatron_like.training.job_lock import hold_checkpoint_directory
from megatron_like.training.local_checkpoint import LocalCheckpoints, restore_local_checkpoint
from megatron_like.training.logging import TrainingLogger
from megatron_like.training.lr_schedule import LearningRateScheduler
from megatron_like.training.metrics import flops_per_token
from megatron_like.training.parallelize import check_training_flags, parallelize
from megatron_like.training.preflight import check_run_paths
from megatron_like.training.process_setup import keep_freed_memory
from megatron_like.training.signals import SAVE_FAILED, ExitConditions, saving
from megatron_like.training.signals import beat as watchdog_beat
from megatron_like.training.stragglers import StragglerReport

ModelProvider = Callable[..., nn.Module]
DatasetsProvider = Callable[[Config, ParallelState, tuple[int, int, int]], tuple[Any, Any, Any]]


@dataclass
class TrainingResult:
    """What a run did, for tests and callers (losses are only known on the last pipeline stage)."""

    iteration: int = 0
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    validation_losses: list[float] = field(default_factory=list)
    validation_stats: list[dict[str, float]] = field(default_factory=list)
    """Every statistic of each validation run (e.g. 'loss' and 'accuracy' of a classifier)."""
    model: list[nn.Module] = field(default_factory=list)
    loss_scales: list[float] = field(default_factory=list)
    """Loss scale used by each iteration (1.0 without --fp16)."""
    skipped_iterations: int = 0
    """Iterations whose update was skipped (fp16 gradient overflow, a bad step)."""
    bad_iterations: list[int] = field(default_factory=list)
    """Iterations skipped as bad: a NaN/Inf loss or gradient, a loss spike (training/bad_steps.py)."""
    exit_status: int = 0
    """The status the run exits with: 0, or a bad step's (training/bad_steps.py; pretrain raises SystemExit)."""
    nan_iterations: int = 0
    """Iterations whose loss was inf or nan."""
    optimizer: DistributedOptimizer | None = None
    moe_losses: list[dict[str, float]] = field(default_factory=list)
    """Each iteration's MoE router losses (load_balancing_loss, z_loss), as logged; empty without MoE."""
    expert_biases: list[dict[int, torch.Tensor]] = field(default_factory=list)
    """Each iteration's expert biases after its update, ``{global layer: bias [E]}`` of this rank's MoE layers
    (--moe-router-enable-expert-bias; empty without it)."""
    loss_stats: list[dict[str, float]] = field(default_factory=list)
    """Each iteration's loss statistics as logged ('lm loss', 'mtp_1 loss', ...; last pipeline stage only)."""


def check_supported(config: Config) -> None:
    """Refuse invalid flag combinations and unusable --save/--load paths before any process starts working
    (ConfigError, one line)."""
    check_training_flags(config)
    if config.training.train_iters < 1:
        raise ConfigError(f"--train-iters {config.training.train_iters} trains nothing; pass a positive number "
                          "(tools/evaluate.py evaluates a checkpoint without training)")
    check_run_paths(config)
    if config.checkpoint.local_checkpoint_interval and config.parallel.zero_stage == 3:
        raise ConfigError("--local-checkpoint-interval keeps each rank's parameters as they are between steps, which "
                          "ZeRO-3 does not hold whole; use --zero-stage 2 or less, or drop the flag")
    for text in config.resilience.inject_fault:
        parse_fault(text)


def print_rank(ps: ParallelState, message: str, rank: int = 0) -> None:
    if ps.rank == (rank % ps.world_size):
        print(message, flush=True)


def build_model_chunks(config: Config, ps: ParallelState, model_provider: ModelProvider) -> list[nn.Module]:
    """One model chunk per virtual pipeline stage of this rank.

    At ZeRO-3 the parameters are built deferred (on the meta device, no memory) and ``parallelize`` draws
    them unit by unit straight into this rank's shards, so start-up never holds the unsharded stage
    (``tensor_parallel/initialization.py``); until then they have shapes and attributes but no values.
    """
    placement = ChunkPlacement(ps.pp_size, config.virtual_pipeline_size, config.parallel.v_shape)
    chunks = []
    with deferred_init(enabled=config.parallel.zero_stage == 3):
        for vp_rank in range(placement.vp_size):
            layers = chunk_layers(config.model.num_layers, ps.pp_size, ps.pp_rank, placement.vp_size, vp_rank,
                                  placement.v_shape)
            chunks.append(
                model_provider(
                    config, ps, layers=layers,
                    pre_process=placement.is_first(ps.pp_rank, vp_rank),
                    post_process=placement.is_last(ps.pp_rank, vp_rank),
                )
            )
    return chunks


def main_loss(losses: dict[str, float]) -> float:
    """The loss a run reports: 'lm loss' (GPT), else 'loss' (other tasks' loss_func), else nan."""
    return losses.get("lm loss", losses.get("loss", float("nan")))


def average_losses(stats: list[dict[str, torch.Tensor]], ps: ParallelState) -> dict[str, float]:
    """Mean of each statistic over micro batches and data-parallel ranks (last stage only)."""
    if not stats:
        return {}
    names = sorted(stats[0])
    means = torch.stack([torch.stack([s[n].detach().float() for s in stats]).mean() for n in names])
    comm.all_reduce(means, ps.dp_group, op="avg")
    return dict(zip(names, means.tolist()))


def moe_loss_names(config: Config) -> list[str]:
    """The router losses MoE layers record and the log shows (docs/moe.md), in log order."""
    m = config.model
    if m.num_experts is None:
        return []
    names = ["load_balancing_loss"] if m.moe_router_load_balancing_type in ("aux_loss", "seq_aux_loss") else []
    return names + (["z_loss"] if m.moe_z_loss_coeff is not None else [])


@dataclass
class StepOutput:
    """What one training step did."""

    losses: dict[str, float]
    """Loss statistics averaged over micro batches and dp ranks (empty off the last stage)."""
    grad_norm: float | None
    """Global gradient norm before clipping; None when the step was skipped."""
    skipped: bool
    """No update: the fp16 gradients overflowed (the loss scale backed off) or the step was bad."""
    loss_scale: float
    """The loss scale this step's backward used."""
    moe_losses: dict[str, float] = field(default_factory=dict)
    """MoE router losses: mean over MoE layers, micro batches and dp ranks (every rank knows them)."""
    expert_biases: dict[int, torch.Tensor] = field(default_factory=dict)
    """This rank's MoE layers' expert biases after this step's update (empty without expert bias)."""
    bad: bool = False
    """Some rank found the step bad (training/bad_steps.py): nothing was applied."""


def _with_mapped_loss(forward_step_func: Callable, mapping: Callable[[torch.Tensor, dict], tuple]) -> Callable:
    """``forward_step_func`` whose loss function's ``(loss, stats)`` come out through ``mapping``."""

    def forward_step(data_iterator: Any, chunk: nn.Module) -> tuple[torch.Tensor, Callable]:
        output, loss_func = forward_step_func(data_iterator, chunk)
        return output, lambda output_tensor: mapping(*loss_func(output_tensor))

    return forward_step


def _nan_loss(loss: torch.Tensor, stats: dict) -> tuple[torch.Tensor, dict]:
    """Fault injection's bad batch: the loss and every statistic NaN (the backward spreads it to the gradients)."""
    return loss * float("nan"), {name: value * float("nan") for name, value in stats.items()}


def _spiked_loss(loss: torch.Tensor, stats: dict) -> tuple[torch.Tensor, dict]:
    """Fault injection's loss spike: the loss and every statistic SPIKE_FACTOR x larger."""
    return loss * SPIKE_FACTOR, {name: value * SPIKE_FACTOR for name, value in stats.items()}


def train_step(config: Config, ps: ParallelState, forward_step_func: Callable, data_iterator: Any,
               model: list[nn.Module], optimizer: DistributedOptimizer, scheduler: LearningRateScheduler, *,
               iteration: int = 0, guard: BadStepGuard | None = None,
               stragglers: StragglerReport | None = None) -> StepOutput:
    """One optimizer step over a global batch (``iteration``, 1-based: for --inject-fault).

    Main grads are zeroed, the schedule runs every micro batch (the backward hooks accumulate into the
    fp32 buffers and reduce buckets), ``finish_grad_sync`` completes the reductions, and the optimizer
    unscales, checks, clips and updates. The lr schedule advances only when the update happened. ``guard``
    judges the step (a bad one applies nothing: training/bad_steps.py); ``stragglers`` times its compute.
    """
    data_parallel = optimizer.data_parallel
    data_parallel.start_grad_sync(config.num_microbatches)
    loss_scale = optimizer.loss_scale
    if should_inject("nan_loss", iteration, ps.rank) or should_inject("transient", iteration, ps.rank):
        forward_step_func = _with_mapped_loss(forward_step_func, _nan_loss)
    if should_inject("loss_spike", iteration, ps.rank):
        forward_step_func = _with_mapped_loss(forward_step_func, _spiked_loss)
    if optimizer.scaler is not None:
        forward_step_func = _with_mapped_loss(forward_step_func,
                                              lambda loss, stats: (optimizer.scale_loss(loss), stats))
    schedule = get_forward_backward_func(ps.pp_size, config.virtual_pipeline_size,
                                         config.parallel.pipeline_schedule)
    # MoE routers' losses get the gradient they would have as part of each micro batch's loss (aux_losses.py).
    reset_aux_losses()
    set_aux_loss_backward_scale(loss_scale / config.num_microbatches)
    if stragglers is not None:
        stragglers.start()
    if should_inject("slow", iteration, ps.rank):
        time.sleep(SLOW_SECONDS)
    stats = schedule(forward_step_func, data_iterator, model, config.num_microbatches,
                     seq_length=config.model.seq_length, micro_batch_size=config.training.micro_batch_size)
    if stragglers is not None:
        stragglers.stop()
    moe_losses = reduce_aux_losses(moe_loss_names(config), config.model.moe_layers, config.num_microbatches, ps)
    data_parallel.finish_grad_sync()
    if config.checkpoint.async_save:
        # A save of the previous iteration may still be copying the params and optimizer state in the
        # background (dist_checkpointing.py): the step is the first thing that changes them in place.
        from megatron_like.training.dist_checkpointing import wait_for_async_staging

        wait_for_async_staging()
    if should_inject("nan_grad", iteration, ps.rank):  # after the reduction: this rank's gradients alone
        for bucket in optimizer.buckets:
            bucket.grad_shard.fill_(float("nan"))
    check = guard is not None and guard.check_nan
    result = optimizer.step(suspicious=guard is not None and guard.suspicious(stats), check_finite=check)
    if result.successful:
        scheduler.step()
    expert_biases = {}
    if result.bad:  # a bad step moves nothing: its routed-token counts go too (a rerun counts afresh)
        for router in routers_with_expert_bias(model):
            router.tokens_per_expert.zero_()
    else:  # auxiliary-loss-free balancing: from the tokens routed in this step, on every rank alike (expert_bias.py)
        expert_biases = update_expert_biases(model, ps)
    losses = average_losses(stats, ps)
    if losses:  # the log line shows them after the LM loss
        losses.update(moe_losses)
    return StepOutput(losses, result.grad_norm, not result.successful, loss_scale, moe_losses, expert_biases,
                      bad=result.bad)


def forward_only_stats(config: Config, ps: ParallelState, forward_step_func: Callable, data_iterator: Any,
                       model: list[nn.Module], num_batches: int) -> list[dict[str, torch.Tensor]]:
    """The loss statistics of every micro batch of ``num_batches`` global batches, run in eval mode
    without gradients (last pipeline stage; empty elsewhere). The chunks are back in train mode after."""
    for chunk in model:
        chunk.eval()
    schedule = get_forward_backward_func(ps.pp_size, config.virtual_pipeline_size,
                                         config.parallel.pipeline_schedule)
    stats = []
    with torch.no_grad():
        for _ in range(num_batches):
            stats += schedule(forward_step_func, data_iterator, model, config.num_microbatches, forward_only=True,
                              seq_length=config.model.seq_length, micro_batch_size=config.training.micro_batch_size)
            watchdog_beat()  # a long evaluation is progress, not a hang
    for chunk in model:
        chunk.train()
    return stats


def evaluate(config: Config, ps: ParallelState, forward_step_func: Callable, data_iterator: Any,
             model: list[nn.Module], num_batches: int) -> dict[str, float]:
    """Mean loss over ``num_batches`` global batches without gradients."""
    return average_losses(forward_only_stats(config, ps, forward_step_func, data_iterator, model, num_batches), ps)


def _full_params_for_save(config: Config, model: list[nn.Module]) -> contextlib.AbstractContextManager:
    """The torch format saves full parameters (gathered at ZeRO-3); torch_dist writes from each rank's shards.

    Both first finish the gathers of updated params that ``--overlap-param-gather`` leaves to the next forward.
    ``--ckpt-naming megatron`` saves through torch_dist whatever the format (megatron_export.py).
    """
    if config.checkpoint.ckpt_format == "torch" and config.checkpoint.ckpt_naming == "ours":
        return gathered_parameters(model)
    for chunk in model:
        buffer = getattr(chunk, "param_and_grad_buffer", None)
        if buffer is not None:
            buffer.finish_param_sync()
    return contextlib.nullcontext()


def save_and_report(config: Config, ps: ParallelState, iteration: int, model: list[nn.Module],
                    optimizer: DistributedOptimizer, scheduler: LearningRateScheduler, consumed: int) -> None:
    """Save the checkpoint of ``iteration`` under the watchdog's save limit; say so once it is complete (an
    ``--async-save`` says it started; its background write prints the completion)."""
    save = config.checkpoint.save
    with saving(f"saving the checkpoint of iteration {iteration}"), _full_params_for_save(config, model):
        save_checkpoint(save, iteration, config, ps, model, optimizer, scheduler, consumed)
    if config.checkpoint.async_save:
        print_rank(ps, f" > started saving checkpoint at iteration {iteration} to {save} in the background")
    else:
        print_rank(ps, f" > saved checkpoint at iteration {iteration} to {save}")


def _stop_on_failed_background_save(ps: ParallelState) -> None:
    """Every rank learnt in the same iteration that a background save failed: raise its agreed error."""
    from megatron_like.training.dist_checkpointing import wait_for_async_save

    wait_for_async_save(ps)


def _background_save_failed(config: Config) -> bool:
    if not config.checkpoint.async_save:
        return False
    from megatron_like.training.dist_checkpointing import background_save_failed

    return background_save_failed()


def pretrain(config: Config, model_provider: ModelProvider, forward_step_func: Callable,
             datasets_provider: DatasetsProvider, ps: ParallelState | None = None,
             padded_vocab_size: int | None = None) -> TrainingResult:
    """Train ``config.training.train_iters`` steps; see the module docstring for the order of events."""
    check_supported(config)
    refresh_kernel_environment()  # MEGATRON_LIKE_NO_CSRC as it is now, should this process have changed it
    ps = ps or ParallelState.initialize(config.parallel, config.world_size)
    print_rank(ps, f" > {keep_freed_memory(config.training.keep_freed_memory, ps.device).reason}")
    lock = hold_checkpoint_directory(config.checkpoint.save, ps)  # one job per --save directory
    install_faults(config.resilience.inject_fault)  # a test tool; empty (off) unless --inject-fault is given
    seed_everything(config.training.seed, ps.tp_rank, ps.pp_rank, ps.device.type)
    model = build_model_chunks(config, ps, model_provider)
    if ps.dp_cp_rank == 0:  # one line per (tensor, pipeline) rank: cp ranks hold the same parameters
        n_params = sum(p.numel() for chunk in model for p in chunk.parameters())
        print(f" > number of parameters on (tensor, pipeline) model parallel rank ({ps.tp_rank}, "
              f"{ps.pp_rank}): {n_params}", flush=True)
    _, optimizer = parallelize(config, ps, model)
    scheduler = LearningRateScheduler(optimizer, config.optimizer, config.training.train_iters,
                                      use_checkpoint_values=config.checkpoint.use_checkpoint_opt_param_scheduler)

    iteration, consumed = 0, 0
    local = LocalCheckpoints(config, ps) if config.checkpoint.local_checkpoint_interval else None
    restored = None
    if local is not None:  # newer than the persistent checkpoint when every rank's copy survived a restart
        persistent = latest_iteration(config.checkpoint.load) if config.checkpoint.load else None
        restored = restore_local_checkpoint(config, ps, model, optimizer, scheduler, persistent)
    if restored is not None:
        iteration, consumed = restored
        print_rank(ps, f" > restored the local checkpoints of iteration {iteration} (--local-checkpoint-interval)")
    elif config.checkpoint.load and latest_iteration(config.checkpoint.load) is None:
        # Megatron's rule, so that `--save D --load D` under `torchrun --max-restarts` starts and resumes.
        print_rank(ps, f" > WARNING: --load {config.checkpoint.load} holds no checkpoint; starting from scratch")
    elif config.checkpoint.load:
        # Every rank checks its files first and all agree: no rank trains while another one stops.
        validate_checkpoint(config.checkpoint.load, config, ps, model, optimizer)
        # ZeRO-3 params hold no memory between uses: gather them to load into, keep this rank's shard.
        with gathered_parameters(model, write_back=True):
            iteration, consumed = load_checkpoint(config.checkpoint.load, config, ps, model, optimizer, scheduler)
        if not optimizer.master_loaded:
            optimizer.reload_model_params()
        print_rank(ps, f" > loaded checkpoint from {config.checkpoint.load} at iteration {iteration}")

    t, log = config.training, config.logging
    gbs = config.global_batch_size
    eval_runs = t.train_iters // log.eval_interval + 1
    # The train iterator starts at `consumed`: a run resumed with a smaller --global-batch-size than its
    # checkpoint's still needs (train_iters - iteration) batches after the samples already consumed.
    train_samples = max(t.train_iters * gbs, consumed + max(t.train_iters - iteration, 0) * gbs)
    num_samples = (train_samples, eval_runs * log.eval_iters * gbs, log.eval_iters * gbs)
    train_ds, valid_ds, test_ds = datasets_provider(config, ps, num_samples)

    def data_iterator(dataset: Any, consumed_samples: int) -> Any:
        loader = build_pretraining_data_loader(dataset, consumed_samples, t.micro_batch_size, ps.dp_rank,
                                               ps.dp_size, config.data.num_workers,
                                               pin_memory=ps.device.type == "cuda")
        return None if loader is None else iter(loader)

    train_iter = data_iterator(train_ds, consumed)
    valid_iter = data_iterator(valid_ds, 0)

    result = TrainingResult(iteration=iteration, model=model, optimizer=optimizer)
    interval_skipped = interval_nan = 0
    vocab = padded_vocab_size or getattr(model[-1], "vocab_size", 0)
    flops = flops_per_token(config, vocab)
    logger = TrainingLogger(config, ps)
    # Preemption signals, time limit, and a watchdog against hung collectives.
    exit_conditions = ExitConditions(config.checkpoint, ps.device, config.parallel.distributed_timeout_minutes)
    interval_start, interval_iters = time.perf_counter(), 0
    # Bad steps caught (and rerun with --rerun-mode validate_results), slow ranks named: docs/checkpoints.md.
    guard = BadStepGuard(config, ps, train_iter)
    resilience = config.resilience
    stragglers = StragglerReport(ps, resilience.straggler_threshold) if resilience.log_straggler else None
    for chunk in model:
        chunk.train()
    while iteration < t.train_iters:
        step_faults(iteration + 1, ps.rank)

        def one_step(data: Any, number: int = iteration + 1) -> StepOutput:
            return train_step(config, ps, forward_step_func, data, model, optimizer, scheduler, iteration=number,
                              guard=guard, stragglers=stragglers)

        with logger.watch_step(iteration + 1, model, optimizer):  # measures memory on CPU (logging.py)
            step, result.exit_status = guard.run(one_step, iteration + 1, consumed)
        if step.bad:
            result.bad_iterations.append(iteration + 1)
        losses, grad_norm = step.losses, step.grad_norm
        got_nan = any(not math.isfinite(v) for v in losses.values())
        result.loss_scales.append(step.loss_scale)
        result.skipped_iterations += int(step.skipped)
        result.nan_iterations += int(got_nan)
        interval_skipped += int(step.skipped)
        interval_nan += int(got_nan)
        iteration += 1
        consumed += gbs
        interval_iters += 1
        result.iteration = iteration
        if losses:
            result.losses.append(main_loss(losses))
            result.loss_stats.append(dict(losses))
        if step.moe_losses:
            result.moe_losses.append(step.moe_losses)
        if step.expert_biases:
            result.expert_biases.append(step.expert_biases)
        result.grad_norms.append(float("nan") if grad_norm is None else grad_norm)
        if iteration % log.log_interval == 0:
            elapsed = (time.perf_counter() - interval_start) / interval_iters
            tokens_per_second = gbs * config.model.seq_length / elapsed
            logger.training(
                iteration=iteration, consumed_samples=consumed, elapsed_ms=elapsed * 1000.0,
                tokens_per_second=tokens_per_second, tflops_per_device=flops * tokens_per_second / ps.world_size / 1e12,
                learning_rate=optimizer.param_groups[0]["lr"], losses=losses, loss_scale=step.loss_scale,
                grad_norm=grad_norm, skipped_iterations=interval_skipped, nan_iterations=interval_nan,
            )
            interval_start, interval_iters = time.perf_counter(), 0
            interval_skipped = interval_nan = 0
            if stragglers is not None:
                stragglers.report(iteration)
        if valid_iter is not None and log.eval_iters > 0 and iteration % log.eval_interval == 0:
            valid = evaluate(config, ps, forward_step_func, valid_iter, model, log.eval_iters)
            if valid:
                result.validation_losses.append(main_loss(valid))
                result.validation_stats.append(valid)
                logger.evaluation(iteration, valid)
        ckpt = config.checkpoint
        exit_reason = exit_conditions.check(iteration, _background_save_failed(config))
        if exit_reason == SAVE_FAILED:
            _stop_on_failed_background_save(ps)
        if result.exit_status:
            exit_reason = f"bad steps: exit status {result.exit_status}, docs/checkpoints.md"
        should_exit = exit_reason is not None
        if ckpt.save and ((ckpt.save_interval and iteration % ckpt.save_interval == 0) or should_exit):
            save_and_report(config, ps, iteration, model, optimizer, scheduler, consumed)
        if local is not None and local.due(iteration):
            local.save(iteration, consumed, model, optimizer, scheduler)
        if should_exit:
            print_rank(ps, f" > exiting at iteration {iteration} ({exit_reason})")
            break
    else:
        if config.checkpoint.save and not (config.checkpoint.save_interval
                                           and iteration % config.checkpoint.save_interval == 0):
            save_and_report(config, ps, iteration, model, optimizer, scheduler, consumed)
        exit_conditions.beat()
        test_iter = data_iterator(test_ds, 0)
        if test_iter is not None and log.eval_iters > 0:
            logger.evaluation(iteration, evaluate(config, ps, forward_step_func, test_iter, model, log.eval_iters),
                              split="test")
    optimizer.data_parallel.finish_param_sync()  # the returned model holds its final params (overlap-param-gather)
    if config.checkpoint.async_save:  # the last checkpoint is complete and named before the run returns
        from megatron_like.training.dist_checkpointing import wait_for_async_save

        wait_for_async_save(ps)  # under the watchdog's save limit
    if local is not None and iteration >= t.train_iters:  # done: the copies are no use any more
        local.close()
    exit_conditions.close()
    logger.close()
    lock.release()
    if result.exit_status:  # for the launcher (docs/checkpoints.md "Preemption and faults"), as Megatron-LM exits
        comm.shutdown()
        raise SystemExit(result.exit_status)
    return result
