"""The optimizer of every run: fp32 master weights and AdamW state over this rank's ZeRO shards.

It works on the flat buffers of :class:`megatron_like.distributed.DataParallel`. For each bucket it
owns the rank's shard (the whole bucket without ZeRO, ``1 / dp`` of it with ZeRO 1-3):

* ``master``: fp32 copy of the shard's parameters. When the params are fp32 and stay on their device
  the master *is* the param shard (no copy: fp32 training costs no extra 4 bytes per param).
  With ``--optimizer-cpu-offload`` it lives in host memory.
* AdamW state: one (exp_avg, exp_avg_sq) pair per *segment*, the part of one parameter inside the
  shard. Segments are views of the flat master and gradient shards; 1-D params (biases, LayerNorms)
  go to the group without weight decay, as Megatron.

One step (:meth:`DistributedOptimizer.step`), after ``DataParallel.finish_grad_sync``:

1. fp16: unscale the fp32 gradient shards by ``1 / loss_scale``; any inf/nan on any rank skips the step
   and the loss scaler backs off (see loss_scaler.py);
2. global gradient norm over the whole world, each parameter counted once (clip_grads.py), and clipping; the
   same reductions agree on whether any rank found the step bad (a NaN loss or gradient, a loss spike:
   training/bad_steps.py), and a bad step stops here, applying nothing;
3. AdamW on the master shards: ``torch.optim.AdamW(fused=True)``, or the C++ ``CPUAdam`` with offload,
   which in the same pass writes the new bf16/fp16 values into the param shard;
4. master -> param shard (cast) where the two differ; stage 1/2 all-gather the param shards (with
   ``--overlap-param-gather`` unit by unit behind the next forward, see ``distributed/data_parallel.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_like import collectives as comm
from megatron_like.config import OptimizerConfig, PrecisionConfig
from megatron_like.distributed import DataParallel
from megatron_like.optimizer.clip_grads import counts_toward_norm
from megatron_like.optimizer.loss_scaler import LossScaler, build_loss_scaler
from megatron_like.parallel_state import ParallelState


@dataclass
class StepResult:
    """What one optimizer step did."""

    successful: bool
    """False when fp16 gradients overflowed and the update was skipped."""
    grad_norm: float | None
    """Global gradient norm before clipping (None for a skipped step)."""
    bad: bool = False
    """Some rank found the step bad (its loss suspicious, or a non-finite gradient with ``check_finite``): nothing
    was applied, as for an fp16 overflow (training/bad_steps.py)."""


def _needs_host_copy(grad_shard: torch.Tensor, master_device: torch.device) -> bool:
    """Whether the optimizer needs its own copy of ``grad_shard`` on ``master_device``.

    True only with ``--optimizer-cpu-offload`` on a GPU; on CPU the master gradient *is* the shard.
    Tests replace this function to run the GPU's copy path on CPU.
    """
    return grad_shard.device != master_device


@dataclass
class _Segment:
    master: torch.Tensor  # [n] fp32 view of the master shard
    grad: torch.Tensor  # [n] fp32 view of the gradient shard (on the master's device)
    counted: bool  # counts toward the global norm on this rank
    expert: bool = False  # an expert parameter's (MoE): replicated over expert-dp only, distinct over etp x ep


class DistributedOptimizer:
    """AdamW over this rank's shards with fp32 masters, loss scaling, clipping and optional CPU offload."""

    def __init__(self, data_parallel: DataParallel, config: OptimizerConfig, precision: PrecisionConfig,
                 ps: ParallelState, cpu_offload: bool = False) -> None:
        self.data_parallel, self.config, self.ps = data_parallel, config, ps
        self.sharded = data_parallel.zero_stage >= 1 and ps.dp_cp_size > 1
        self.zero = data_parallel.zero_stage >= 1  # buckets hold 1 / (expert-)dp of the gradient
        self.scaler: LossScaler | None = build_loss_scaler(precision)
        self.cpu_offload = cpu_offload
        master_device = torch.device("cpu") if cpu_offload else ps.device
        self.buckets = list(data_parallel.buckets())
        self.masters: list[torch.Tensor] = []  # per bucket, [shard_numel] fp32
        self.master_grads: list[torch.Tensor] = []  # per bucket: grad_shard, or its host copy
        self.master_is_param: list[bool] = []
        self.segments: list[_Segment] = []
        groups: dict[bool, list[torch.Tensor]] = {True: [], False: []}
        self.param_copies: dict[torch.Tensor, torch.Tensor] = {}  # master segment -> bf16/fp16 param segment
        for bucket in self.buckets:
            param_shard = bucket.param_shard
            alias = param_shard.dtype == torch.float32 and param_shard.device == master_device
            master = param_shard if alias else param_shard.detach().to(master_device, torch.float32, copy=True)
            grad = torch.zeros(bucket.shard_numel, dtype=torch.float32, device=master_device) \
                if _needs_host_copy(bucket.grad_shard, master_device) else bucket.grad_shard
            self.masters.append(master)
            self.master_grads.append(grad)
            self.master_is_param.append(alias)
            for param, lo, hi, _, _ in bucket.shard_segments():
                segment = _Segment(master[lo:hi], grad[lo:hi], counts_toward_norm(param, ps), bucket.is_expert)
                segment.master.grad = segment.grad
                self.segments.append(segment)
                groups[param.ndim > 1].append(segment.master)
                if not alias and param_shard.device.type == "cpu":
                    self.param_copies[segment.master] = param_shard[lo:hi]
        param_groups = [{"params": groups[True], "weight_decay": config.weight_decay},
                        {"params": groups[False], "weight_decay": 0.0}]
        param_groups = [g for g in param_groups if g["params"]]
        if not param_groups:  # this rank's shards hold only padding: step an empty tensor
            param_groups = [{"params": [torch.zeros(0, device=master_device)], "weight_decay": 0.0}]
        betas = (config.adam_beta1, config.adam_beta2)
        if cpu_offload:
            from megatron_like.kernels.cpu_adam import CPUAdam

            self.inner: torch.optim.Optimizer = CPUAdam(param_groups, lr=config.lr, betas=betas,
                                                        eps=config.adam_eps, weight_decay=config.weight_decay)
        else:
            self.inner = torch.optim.AdamW(param_groups, lr=config.lr, betas=betas, eps=config.adam_eps,
                                           weight_decay=config.weight_decay, fused=True)
        self.master_loaded = False

    # ---------------------------------------------------------------- what the loop and scheduler read
    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizer's groups (the lr scheduler sets ``lr`` in them)."""
        return self.inner.param_groups

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * loss_scale`` (fp16) or ``loss``: what backward should start from."""
        return loss * self.scaler.scale if self.scaler is not None else loss

    # ---------------------------------------------------------------- the step
    def _unscale_and_check(self, suspicious: bool = False) -> tuple[bool, bool]:
        """Divide the gradient shards by the loss scale; return (any rank found an inf or nan, any rank was
        ``suspicious`` of its loss), agreed in the same reductions."""
        grads = [b.grad_shard for b in self.buckets]
        torch._foreach_mul_(grads, 1.0 / self.scaler.scale)
        finite = torch.stack([g.isfinite().all() for g in grads]).all() if grads else torch.tensor(True)
        found = torch.stack([(~finite).float().reshape(()).to(self.ps.device),
                             torch.tensor(float(suspicious), device=self.ps.device)])
        # Over the whole world (dp x cp, then tp x pp): shards and experts differ across dp and tp ranks.
        comm.all_reduce(found, self.ps.dp_cp_group, op="max")
        comm.all_reduce(found, self.ps.model_parallel_group, op="max")
        found_inf, bad = found.tolist()
        return found_inf > 0, bad > 0

    def grad_norm(self) -> float:
        """L2 norm of the whole model's gradient (each parameter once, every stage and shard)."""
        return self._norm_and_verdict(suspicious=False, check_finite=False)[0]

    def _norm_and_verdict(self, suspicious: bool, check_finite: bool) -> tuple[float, bool]:
        """The global gradient norm, and whether any rank found the step bad: ``suspicious`` of its loss, or (with
        ``check_finite``) holding a non-finite gradient. The verdict rides on the norm's own reductions, plus one of
        a flag over dp without ZeRO, where the norm needs none but a rank's gradient may go bad after its reduction.

        Dense parameters: ZeRO shards are distinct over dp, tp slices over tp, stages over pp. Expert parameters
        (MoE, docs/moe.md): slices distinct over the ``etp x ep`` ranks of a stage, ZeRO shards over expert-dp;
        summed over those, every rank of the stage holds the stage's expert total, which tp rank 0 adds once.
        """
        def sum_of_squares(expert: bool) -> torch.Tensor:
            grads = [s.grad for s in self.segments if s.counted and s.expert == expert]
            squares = torch.stack(torch._foreach_norm(grads)).square().sum() if grads else torch.zeros(())
            return squares.reshape(1).to(device=self.ps.device, dtype=torch.float32)

        squares, expert_squares = sum_of_squares(False), sum_of_squares(True)
        flag = torch.tensor([float(suspicious)], device=self.ps.device)
        if check_finite:  # a NaN or Inf anywhere makes the sums non-finite; the segments the norm leaves out count too
            local = squares + expert_squares
            uncounted = [s.grad for s in self.segments if not s.counted]
            if uncounted:  # replicas of tp rank 0's params (small), the last stage's tied-embedding copy
                local = local + torch.stack(torch._foreach_norm(uncounted)).sum().to(local.device)
            flag += (~torch.isfinite(local)).float()
        packed = torch.cat([squares, flag])  # [sum of squares, ranks that found the step bad]
        if self.zero:
            comm.all_reduce(packed, self.ps.dp_cp_group)
        elif check_finite and self.ps.dp_cp_size > 1:
            verdict = packed[1:].clone()
            comm.all_reduce(verdict, self.ps.dp_cp_group, op="max")
            packed[1:] = verdict
        if any(bucket.is_expert for bucket in self.buckets):  # the same on every rank of a pipeline stage
            if self.zero:
                comm.all_reduce(expert_squares, self.ps.expert_dp_group)
            comm.all_reduce(expert_squares, self.ps.expert_tp_ep_group)
            packed[:1] += expert_squares if self.ps.tp_rank == 0 else 0.0
        comm.all_reduce(packed, self.ps.model_parallel_group)
        norm, bad = torch.cat([packed[:1].sqrt(), packed[1:]]).tolist()  # the norm in fp32, as it always was
        return norm, bad > 0

    @torch.no_grad()
    def step(self, suspicious: bool = False, check_finite: bool = False) -> StepResult:
        """Unscale, check, clip and apply AdamW to this rank's shards, then refresh the model params.

        ``suspicious``: this rank judged the step's loss bad; ``check_finite``: a non-finite gradient on any rank
        makes the step bad too (--check-for-nan-in-loss-and-grad). A step some rank finds bad applies nothing.
        """
        if self.scaler is not None:
            found_inf, bad = self._unscale_and_check(suspicious)
            if bad and not found_inf:  # a bad loss is no overflow: the loss scale stays
                return StepResult(successful=False, grad_norm=None, bad=True)
            self.scaler.update(found_inf)
            if found_inf:
                return StepResult(successful=False, grad_norm=None)
            suspicious = False
        # The norm, clipping and AdamW read master_grads: with offload on a GPU these are host copies of
        # the device shards, so refresh them first (a blocking device-to-host copy).
        for bucket, grad in zip(self.buckets, self.master_grads):
            if grad is not bucket.grad_shard:
                grad.copy_(bucket.grad_shard)
        norm, bad = self._norm_and_verdict(suspicious, check_finite)
        if bad:
            return StepResult(successful=False, grad_norm=norm, bad=True)
        if self.config.clip_grad > 0 and math.isfinite(norm):
            coefficient = self.config.clip_grad / (norm + 1e-6)
            if coefficient < 1.0:
                torch._foreach_mul_(self.master_grads, coefficient)
        if self.cpu_offload:
            self.inner.step(param_copies=self.param_copies)
        else:
            self.inner.step()
        self._copy_masters_to_params(skip_written=self.cpu_offload)
        self.data_parallel.gather_updated_params()
        return StepResult(successful=True, grad_norm=norm)

    def _copy_masters_to_params(self, skip_written: bool = False) -> None:
        """Cast each master shard into its param shard (CPUAdam already wrote the CPU ones)."""
        for bucket, master, alias in zip(self.buckets, self.masters, self.master_is_param):
            if alias or (skip_written and bucket.param_shard.device.type == "cpu"):
                continue
            bucket.param_shard.copy_(master)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: ``DataParallel.start_grad_sync`` zeroes the flat gradient buffers."""

    # ---------------------------------------------------------------- checkpoints
    def reload_model_params(self) -> None:
        """Masters <- param shards (after the model's weights were loaded without optimizer state)."""
        for bucket, master, alias in zip(self.buckets, self.masters, self.master_is_param):
            if not alias:
                master.copy_(bucket.param_shard)

    def state_dict(self) -> dict:
        """This rank's shard of the optimizer: AdamW state, fp32 masters (when separate), loss scaler."""
        masters = [m.clone() for m, alias in zip(self.masters, self.master_is_param) if not alias]
        return {
            "optimizer": self.inner.state_dict(),
            "masters": masters,
            "loss_scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "zero_stage": self.data_parallel.zero_stage,
            "dp_size": self.ps.dp_cp_size,  # the ZeRO shards' count and this rank's (dp x cp ranks)
            "dp_rank": self.ps.dp_cp_rank,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output (same layout: zero stage, dp and tp sizes) and the params."""
        dp, dp_rank = self.ps.dp_cp_size, self.ps.dp_cp_rank
        if state.get("dp_size", dp) != dp and self.sharded:
            raise ValueError(f"optimizer shard saved with data-parallel size {state['dp_size']}, this run has "
                             f"{dp}: ZeRO shards cannot be loaded across dp sizes")
        if self.sharded and state.get("dp_rank", dp_rank) != dp_rank:
            raise ValueError(f"optimizer state of data-parallel rank {state['dp_rank']} offered to dp rank "
                             f"{dp_rank}: a ZeRO shard belongs to its rank (resume with --no-load-optim)")
        self.inner.load_state_dict(state["optimizer"])
        separate = [m for m, alias in zip(self.masters, self.master_is_param) if not alias]
        for master, saved in zip(separate, state.get("masters") or []):
            master.copy_(saved)
        if separate and state.get("masters"):
            self.master_loaded = True
            with torch.no_grad():
                self._copy_masters_to_params()
                self.data_parallel.gather_updated_params()
                self.data_parallel.finish_param_sync()  # loaded params are read right away (tests, eval)
        if self.scaler is not None and state.get("loss_scaler") is not None:
            self.scaler.load_state_dict(state["loss_scaler"])

    def state_bytes(self) -> dict[str, int]:
        """Bytes of optimizer state on this rank: separate fp32 masters and AdamW moments."""
        master = sum(m.numel() * m.element_size() for m, alias in zip(self.masters, self.master_is_param)
                     if not alias)
        moments = 0
        for state in self.inner.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    moments += state[key].numel() * state[key].element_size()
        return {"master": master, "moments": moments}
