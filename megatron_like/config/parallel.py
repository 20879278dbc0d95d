"""ParallelConfig: how the model and the batch are split across processes (tp, pp, ep, ZeRO) and its own rules;
the rules that need the world size are Config.validate's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from megatron_like.config.errors import _require
from megatron_like.config.fields import POSITIVE, Range, Requires

SCHEDULES = ("1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev")
"""The values of --pipeline-schedule."""
V_SCHEDULES = ("zb-v", "dualpipev")
"""The schedules that place two model chunks per rank in a V (pipeline_parallel/placement.py)."""
SPLIT_BACKWARD_SCHEDULES = ("zb-h1", "zb-v", "dualpipev")
"""The schedules whose backward is split into B and W (tensor_parallel/weight_grad.py)."""


@dataclass
class ParallelConfig:
    """How the model and the batch are split across processes."""

    tensor_model_parallel_size: Annotated[int, POSITIVE] = 1
    """Processes that split each layer's matmuls (Megatron tensor parallelism)."""
    pipeline_model_parallel_size: Annotated[int, POSITIVE] = 1
    """Pipeline stages that split the layers."""
    num_layers_per_virtual_pipeline_stage: Annotated[int | None, POSITIVE] = None
    """Layers per model chunk for the interleaved 1F1B schedule (several chunks per pipeline rank)."""
    pipeline_schedule: Literal["1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev"] | None = None
    """The pipeline schedule (docs/pipeline.md). Default: interleaved with --num-layers-per-virtual-pipeline-stage,
    else 1f1b. zb-h1: 1F1B whose backwards are split into input gradients (B) and weight gradients (W), the W
    steps filling the pipeline bubble (Qi et al., ICLR 2024), at 1F1B's first-stage activation memory. zb-v and
    dualpipev: two model chunks per rank placed in a V (rank r holds blocks r and 2p-1-r, the loss on rank 0),
    ordered as ZB-V (Qi et al.) or DeepSeek's DualPipeV."""
    context_parallel_size: Annotated[int, POSITIVE] = 1
    """Processes that split each sequence (context parallelism): each holds 2 of the 2 x cp load-balanced chunks
    and attention exchanges keys and values (--cp-comm-type); docs/context_parallel.md."""
    cp_comm_type: Literal["p2p", "all_gather", "a2a", "a2a+p2p"] = "p2p"
    """How attention reaches the keys of the other context-parallel ranks: p2p (ring of key/value blocks),
    all_gather (all keys and values gathered), a2a (all-to-all from sequence shards to head shards, Ulysses),
    a2a+p2p (a2a inside groups of --hierarchical-context-parallel-sizes' first size, a ring across them)."""
    hierarchical_context_parallel_sizes: list[int] | None = None
    """For --cp-comm-type a2a+p2p: two sizes whose product is --context-parallel-size, the all-to-all group
    (inner, consecutive ranks) then the ring across those groups."""
    sequence_parallel: bool = False
    """Shard LayerNorm and dropout activations along the sequence inside the tensor-parallel group."""
    keep_gathered_sequence_for_wgrad: Annotated[bool, Requires("sequence_parallel")] = False
    """With a zero-bubble --pipeline-schedule (zb-h1, zb-v, dualpipev): keep the all-gathered [s, b, .] tensors
    that a deferred weight gradient needs (a column-parallel linear's input, a row-parallel one's output gradient)
    until its W step. Default: keep their [s / tp, b, .] sequence shards and all-gather them again in W. Keeping
    saves one all-gather of [s, b, .] per linear and micro batch (run in W, where no other stage waits for it) and
    costs tp times those tensors' memory in every waiting W stash (docs/pipeline.md)."""
    expert_model_parallel_size: Annotated[int, POSITIVE, Requires("model.num_experts")] = 1
    """Processes that split the experts of each MoE layer; an expert-parallel group is ep consecutive ranks of
    a data-parallel group (Megatron-LM's layout, docs/moe.md)."""
    expert_tensor_parallel_size: Annotated[int | None, POSITIVE] = None
    """Tensor parallelism inside each expert (default --tensor-model-parallel-size); the experts' own layout
    etp x ep x expert-dp covers the tp x dp ranks of a stage (Megatron-core's expert rank generator)."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state across data-parallel ranks (same as --zero-stage 1)."""
    zero_stage: Annotated[int, Range(0, 3)] = 0
    """ZeRO stage over the data-parallel group: 1 optimizer state, 2 + gradients, 3 + parameters."""
    optimizer_cpu_offload: bool = False
    """Keep fp32 master weights and Adam state in host memory, stepped by the C++ Adam."""
    overlap_grad_reduce: bool = False
    """Launch each gradient bucket's data-parallel reduction during backward as soon as it is ready."""
    overlap_param_gather: bool = False
    """Overlap ZeRO's parameter all-gathers with compute: at ZeRO-1/2 the gather of updated params after the
    step runs unit by unit during the next forward; at ZeRO-3 the next unit is gathered while one computes."""
    distributed_backend: Literal["nccl", "gloo"] | None = None
    """Collective backend; by default NCCL when a GPU is present, else gloo."""
    distributed_timeout_minutes: Annotated[float, POSITIVE] = 10.0
    """A collective that waits longer than this fails, so a dead rank stops the job instead of hanging it."""

    @property
    def v_shape(self) -> bool:
        """The schedule places two chunks per rank in a V (zb-v, dualpipev)."""
        return self.pipeline_schedule in V_SCHEDULES

    def validate(self) -> None:
        """The rules between fields (each field's range is declared on it: fields.py)."""
        self.validate_context_parallel()
        _require(not self.v_shape or self.num_layers_per_virtual_pipeline_stage is None,
                 f"--pipeline-schedule {self.pipeline_schedule} places two model chunks per rank in a V, which fixes "
                 "the layers of each chunk: drop --num-layers-per-virtual-pipeline-stage")
        _require(not self.keep_gathered_sequence_for_wgrad or self.pipeline_schedule in SPLIT_BACKWARD_SCHEDULES,
                 "--keep-gathered-sequence-for-wgrad applies to the deferred weight gradients of --pipeline-schedule "
                 f"{', '.join(SPLIT_BACKWARD_SCHEDULES)}: add one, or drop the flag")
        if self.use_distributed_optimizer and self.zero_stage == 0:
            self.zero_stage = 1  # Megatron's name for ZeRO-1
        _require(not self.overlap_param_gather or self.zero_stage >= 1,
                 "--overlap-param-gather needs --zero-stage 1, 2 or 3 (or --use-distributed-optimizer): "
                 "without ZeRO no parameters are gathered")


    def validate_pipeline_schedule(self, vp_size: int) -> None:
        """--pipeline-schedule fits --pipeline-model-parallel-size and the ``vp_size`` model chunks per rank."""
        check_pipeline_schedule_name(self.pipeline_model_parallel_size, vp_size, self.pipeline_schedule)

    def validate_context_parallel(self) -> None:
        """--cp-comm-type and --hierarchical-context-parallel-sizes agree with --context-parallel-size."""
        cp, sizes = self.context_parallel_size, self.hierarchical_context_parallel_sizes
        if self.cp_comm_type != "a2a+p2p":
            _require(sizes is None, f"--hierarchical-context-parallel-sizes {sizes} needs --cp-comm-type a2a+p2p")
            return
        _require(sizes is not None and len(sizes) == 2,
                 f"--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A2A P2P (two sizes), got {sizes}")
        _require(all(size >= 1 for size in sizes) and sizes[0] * sizes[1] == cp,
                 f"--hierarchical-context-parallel-sizes {sizes[0]} {sizes[1]}: their product must be "
                 f"--context-parallel-size {cp}")


def check_pipeline_schedule_name(pp_size: int, vp_size: int, schedule: str | None) -> None:
    """Raise ConfigError (one line) when ``--pipeline-schedule`` does not fit the layout (None: the default)."""
    _require(vp_size == 1 or pp_size > 1 or schedule in V_SCHEDULES,
             "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1")
    if schedule is None:
        return
    _require(schedule in SCHEDULES, f"--pipeline-schedule {schedule}: expected one of {', '.join(SCHEDULES)}")
    _require(pp_size > 1, f"--pipeline-schedule {schedule} needs --pipeline-model-parallel-size > 1")
    _require(schedule != "interleaved" or vp_size > 1,
             "--pipeline-schedule interleaved needs --num-layers-per-virtual-pipeline-stage (more than one chunk "
             "per rank)")
    if schedule in V_SCHEDULES:
        _require(vp_size == 2, f"--pipeline-schedule {schedule} runs two model chunks per rank, not {vp_size}")
        return
    _require(schedule == "interleaved" or vp_size == 1,
             f"--pipeline-schedule {schedule} runs one model chunk per rank: drop "
             "--num-layers-per-virtual-pipeline-stage")
