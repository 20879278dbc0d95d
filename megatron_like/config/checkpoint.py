"""CheckpointConfig: saving, resuming and leaving a run early, and their rules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from megatron_like.config.errors import _require
from megatron_like.config.fields import POSITIVE, Requires


@dataclass
class CheckpointConfig:
    """Saving, resuming and leaving a run early."""

    save: str | None = None
    """Directory to save checkpoints to."""
    load: str | None = None
    """Directory to resume from (its latest_checkpointed_iteration.txt)."""
    save_interval: Annotated[int | None, POSITIVE] = None
    """Save every this many iterations (and always at the end when --save is given)."""
    save_optim: bool = True
    """Save optimizer state (--no-save-optim saves weights only)."""
    load_optim: bool = True
    """Load optimizer state (--no-load-optim restarts Adam)."""
    load_rng: bool = True
    """Load the RNG states (--no-load-rng reseeds)."""
    finetune: bool = False
    """Load weights only and start at iteration 0."""
    ckpt_format: Literal["torch", "torch_dist"] = "torch_dist"
    """Format of new saves: torch_dist (torch.distributed.checkpoint global tensors, loads at any layout;
    Megatron's default) or torch (one file per tp x pp rank, loads only at the same layout); --load
    detects the format (docs/checkpoints.md)."""
    ckpt_naming: Literal["ours", "megatron"] = "ours"
    """Names and files of new saves: ours, or megatron: Megatron-LM's own checkpoint (Megatron-core's names and
    fused layouts, its common state, optimizer, scheduler and RNG entries) in --ckpt-format torch_dist or its legacy
    torch files, at this run's layout, which Megatron-LM and --load here both resume (docs/checkpoints.md)."""
    async_save: bool = False
    """torch_dist only: copy the state to host memory, then write it in a background thread while training
    goes on; the next save and the end of training wait for it."""
    save_timeout_minutes: Annotated[float, POSITIVE] = 60.0
    """How long one checkpoint save (a synchronous write, the wait for the previous asynchronous write, the final
    save) may take before the hang watchdog ends the run as hung; saves are exempt from the per-iteration limit
    (--distributed-timeout-minutes plus 5 s)."""
    keep_last_checkpoints: Annotated[int | None, POSITIVE, Requires("save")] = None
    """Keep only this many newest checkpoints under --save (and the milestones of --keep-checkpoint-every); older
    ones are deleted once a newer one is complete and named by the tracker. Default: keep all."""
    keep_checkpoint_every: Annotated[int | None, POSITIVE, Requires("keep_last_checkpoints")] = None
    """Milestones: a checkpoint whose iteration is a multiple of this is never deleted by --keep-last-checkpoints
    (Orbax's keep_period)."""
    local_checkpoint_interval: Annotated[int | None, POSITIVE, Requires("save")] = None
    """Every this many iterations each rank keeps a copy of its state in host shared memory (/dev/shm) and sends
    one to a peer rank; a restarted job (torchrun --max-restarts) resumes from them when every rank's copy survives,
    else from the newest checkpoint of --save (docs/checkpoints.md)."""
    exit_interval: Annotated[int | None, POSITIVE] = None
    """Save and exit when the iteration is a multiple of this."""
    exit_duration_in_mins: Annotated[float | None, POSITIVE] = None
    """Save and exit after this many minutes of training."""
    exit_signal_handler: bool = True
    """On SIGTERM or SIGUSR1 save a checkpoint (with --save) and exit cleanly (--no-exit-signal-handler: die)."""
    override_opt_param_scheduler: bool = False
    """On resume, take the lr schedule (--lr, --min-lr, warmup, decay iterations, style) from this run's flags, not
    the checkpoint's. Without this flag or --use-checkpoint-opt-param-scheduler, a resume whose flags define
    another schedule than the checkpoint's is refused (Megatron-LM's rule). Also --override-opt_param-scheduler."""
    use_checkpoint_opt_param_scheduler: bool = False
    """On resume, keep the checkpoint's lr schedule and ignore this run's lr flags. Also
    --use-checkpoint-opt_param-scheduler."""

    def validate(self) -> None:
        _require(not (self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler),
                 "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler exclude each other: "
                 "pass one (this run's lr flags, or the checkpoint's schedule)")
        _require(not self.async_save or self.ckpt_naming == "ours",
                 "--async-save writes our own naming only; drop it with --ckpt-naming megatron")
        _require(not self.async_save or self.ckpt_format == "torch_dist",
                 "--async-save writes torch_dist checkpoints only; drop --ckpt-format torch")
