"""Where each kind of parallelism is applied to a run's model, in one fixed order.

1. **Tensor (and sequence) parallelism**: inside the layers, at construction (``model_provider``):
   each rank builds only its slices of the weights.
2. **Pipeline parallelism**: ``build_model_chunks`` gives each rank the layers of its stage(s).
3. **Activation recomputation**: the model reads ``--recompute-*`` at forward
   (``transformer.forward_layers`` for full, ``SelfAttention`` for selective); nothing is wrapped.
4. **Data parallelism and ZeRO** (:func:`parallelize`): ``DataParallel`` moves every parameter into
   flat buffers, installs the gradient hooks (bucketed, optionally overlapped reduction) and, at
   ZeRO-3, the gather/free hooks. It must come after 1-3: it needs the final parameters and modules.
5. **Optimizer**: ``DistributedOptimizer`` over this rank's shards (fp32 masters, loss scaling,
   clipping, CPU offload). It must come after 4: its masters are views of the shards.

:func:`check_training_flags` rejects invalid combinations of these flags before any process group starts.
"""

from __future__ import annotations

from torch import nn

from megatron_like.config import Config, ConfigError
from megatron_like.distributed import DataParallel
from megatron_like.optimizer import DistributedOptimizer
from megatron_like.parallel_state import ParallelState


def check_training_flags(config: Config) -> None:
    """Raise ConfigError (one line: flag, value, rule) for precision/recompute/ZeRO flags that cannot work."""
    prec, m = config.precision, config.model
    if prec.loss_scale is not None and not prec.fp16:
        raise ConfigError(f"--loss-scale {prec.loss_scale} only applies with --fp16 (bf16 and fp32 need no "
                          "loss scaling); drop it or add --fp16")
    if prec.fp16 and prec.loss_scale is None and prec.initial_loss_scale < prec.min_loss_scale:
        raise ConfigError(f"--initial-loss-scale {prec.initial_loss_scale} is below --min-loss-scale "
                          f"{prec.min_loss_scale}")
    if m.recompute_granularity == "full" and m.recompute_method == "block":
        layers_per_chunk = m.num_layers // (config.parallel.pipeline_model_parallel_size
                                            * config.virtual_pipeline_size)
        if m.recompute_num_layers > layers_per_chunk:
            raise ConfigError(
                f"--recompute-num-layers {m.recompute_num_layers} exceeds the {layers_per_chunk} layers of each "
                "model chunk (--recompute-method block recomputes the first N layers of every chunk)"
            )


def parallelize(config: Config, ps: ParallelState, model: list[nn.Module]) -> tuple[DataParallel,
                                                                                      DistributedOptimizer]:
    """Apply data parallelism / ZeRO (step 4) and build the optimizer (step 5) for this rank's chunks."""
    p = config.parallel
    data_parallel = DataParallel(model, ps, zero_stage=p.zero_stage, overlap_grad_reduce=p.overlap_grad_reduce,
                                 overlap_param_gather=p.overlap_param_gather)
    optimizer = DistributedOptimizer(data_parallel, config.optimizer, config.precision, ps,
                                     cpu_offload=p.optimizer_cpu_offload)
    return data_parallel, optimizer
