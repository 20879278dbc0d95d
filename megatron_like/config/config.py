"""Config: the groups composed into everything a run needs, its derived sizes (data-parallel size, micro
batches, ...), the rules that span groups, and the round trip through a dict (checkpoints)."""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field

from megatron_like.config.checkpoint import CheckpointConfig
from megatron_like.config.data import DataConfig
from megatron_like.config.errors import _require
from megatron_like.config.fields import check_declared
from megatron_like.config.logging import LoggingConfig
from megatron_like.config.model import ModelConfig
from megatron_like.config.optimizer import OptimizerConfig
from megatron_like.config.parallel import ParallelConfig
from megatron_like.config.precision import PrecisionConfig
from megatron_like.config.resilience import ResilienceConfig
from megatron_like.config.training import TrainingConfig


@dataclass
class Config:
    """Everything a run needs. Groups are plain dataclasses; derived sizes are properties."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)
    world_size: int = 1
    """Number of processes, taken from the launcher (WORLD_SIZE)."""

    # ---------------------------------------------------------------- derived sizes
    @property
    def data_parallel_size(self) -> int:
        """Ranks that read different batches: the world over tp x cp x pp (cp ranks share a batch)."""
        return self.world_size // self.model_parallel_size

    @property
    def model_parallel_size(self) -> int:
        """Ranks that hold one batch together: tp x cp x pp."""
        p = self.parallel
        return p.tensor_model_parallel_size * p.context_parallel_size * p.pipeline_model_parallel_size

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.training.micro_batch_size * self.data_parallel_size)

    @property
    def global_batch_size(self) -> int:
        t = self.training
        return t.global_batch_size or t.micro_batch_size * self.data_parallel_size

    @property
    def virtual_pipeline_size(self) -> int:
        """Model chunks per pipeline rank (1 without the interleaved schedule; 2 under zb-v and dualpipev)."""
        p = self.parallel
        if p.v_shape:
            return 2
        if p.num_layers_per_virtual_pipeline_stage is None:
            return 1
        return self.model.num_layers // (p.pipeline_model_parallel_size * p.num_layers_per_virtual_pipeline_stage)

    def padded_vocab_size(self, vocab_size: int) -> int:
        """Vocabulary padded to a multiple of --make-vocab-size-divisible-by * tp (Megatron's rule)."""
        multiple = self.model.make_vocab_size_divisible_by * self.parallel.tensor_model_parallel_size
        return int(math.ceil(vocab_size / multiple) * multiple)

    @property
    def params_dtype_name(self) -> str:
        """The parameters' dtype as torch names it (`getattr(torch, name)` is the dtype; config imports no torch)."""
        if self.precision.fp16:
            return "float16"
        if self.precision.bf16:
            return "bfloat16"
        return "float32"

    # ---------------------------------------------------------------- validation
    def validate(self) -> Config:
        """Check every field's declared range and needed flags, then every group's rules and every cross-group
        rule; raise ConfigError on the first violation."""
        check_declared(self.groups())
        for group in self.groups().values():
            group.validate()
        m, p, t = self.model, self.parallel, self.training
        tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
        _require(
            m.num_attention_heads % tp == 0,
            f"--num-attention-heads {m.num_attention_heads} is not divisible by "
            f"--tensor-model-parallel-size {tp}",
        )
        _require(
            m.hidden_size % tp == 0,
            f"--hidden-size {m.hidden_size} is not divisible by --tensor-model-parallel-size {tp}",
        )
        _require(
            m.query_groups % tp == 0,
            f"--num-query-groups {m.query_groups} is not divisible by --tensor-model-parallel-size {tp} "
            "(each tp rank holds whole key/value heads)",
        )
        _require(
            m.ffn_size % tp == 0,
            f"--ffn-hidden-size {m.ffn_size} is not divisible by --tensor-model-parallel-size {tp}",
        )
        cp = p.context_parallel_size
        if cp == 1:
            _require(
                self.world_size % (tp * pp) == 0,
                f"world size {self.world_size} is not divisible by --tensor-model-parallel-size {tp} * "
                f"--pipeline-model-parallel-size {pp}; launch a multiple of {tp * pp} processes",
            )
        else:
            _require(
                self.world_size % (tp * cp * pp) == 0,
                f"world size {self.world_size} is not divisible by --tensor-model-parallel-size {tp} * "
                f"--context-parallel-size {cp} * --pipeline-model-parallel-size {pp}; launch a multiple of "
                f"{tp * cp * pp} processes",
            )
            self.validate_context_parallel()
        if p.sequence_parallel:
            _require(
                m.seq_length % (tp * cp) == 0,
                f"--seq-length {m.seq_length} is not divisible by --tensor-model-parallel-size {tp}"
                + (f" * --context-parallel-size {cp}" if cp > 1 else "") + " (needed by --sequence-parallel)",
            )
        _require(
            m.num_layers % pp == 0,
            f"--num-layers {m.num_layers} is not divisible by --pipeline-model-parallel-size {pp}",
        )
        if p.num_layers_per_virtual_pipeline_stage is not None:
            v = p.num_layers_per_virtual_pipeline_stage
            _require(pp > 1, "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1")
            _require(
                (m.num_layers // pp) % v == 0,
                f"--num-layers-per-virtual-pipeline-stage {v} does not divide the "
                f"{m.num_layers // pp} layers of each pipeline stage (--num-layers {m.num_layers} / "
                f"--pipeline-model-parallel-size {pp})",
            )
        _require(not p.v_shape or m.num_layers % (2 * pp) == 0,
                 f"--pipeline-schedule {p.pipeline_schedule} needs --num-layers {m.num_layers} divisible by 2 * "
                 f"--pipeline-model-parallel-size {pp} (two equal chunks per rank)")
        p.validate_pipeline_schedule(self.virtual_pipeline_size)
        dp = self.data_parallel_size
        self.validate_moe_layout()
        if t.global_batch_size is not None:
            _require(
                t.global_batch_size % (t.micro_batch_size * dp) == 0,
                f"--global-batch-size {t.global_batch_size} is not divisible by --micro-batch-size "
                f"{t.micro_batch_size} * data-parallel size {dp}",
            )
        if self.virtual_pipeline_size > 1 and not p.v_shape:
            _require(
                self.num_microbatches % pp == 0,
                f"the interleaved schedule needs the number of micro batches ({self.num_microbatches} = "
                f"--global-batch-size / (--micro-batch-size * dp)) to be a multiple of "
                f"--pipeline-model-parallel-size {pp}",
            )
        if self.data.mock_data or self.data.tokenizer_type == "NullTokenizer":
            _require(
                m.vocab_size is not None and m.vocab_size > 0,
                "--mock-data and the NullTokenizer need a positive --vocab-size",
            )
        return self

    def validate_context_parallel(self) -> None:
        """Context parallelism's rules: the sequence cuts into 2 x cp chunks, and the all-to-all modes split the
        heads of each tp rank (query heads and key/value heads) over their all-to-all group."""
        m, p = self.model, self.parallel
        tp, cp = p.tensor_model_parallel_size, p.context_parallel_size
        _require(m.seq_length % (2 * cp) == 0,
                 f"--seq-length {m.seq_length} is not divisible by 2 * --context-parallel-size {cp} (each "
                 "context-parallel rank keeps two of 2 x cp equal chunks)")
        _require(not self.checkpoint.save or self.checkpoint.ckpt_format == "torch_dist",
                 f"--ckpt-format torch cannot save --context-parallel-size {cp} (its files are cut per tp, pp and dp "
                 "rank); use --ckpt-format torch_dist")
        _require(cp == 1 or m.dropout_rng == "megatron" or m.attention_dropout == 0,
                 f"--dropout-rng {m.dropout_rng} draws attention dropout per whole head, which --context-parallel-size "
                 f"{cp} splits over ranks: use --dropout-rng megatron or --attention-dropout 0")
        a2a = {"a2a": cp, "a2a+p2p": (p.hierarchical_context_parallel_sizes or [1])[0]}.get(p.cp_comm_type, 1)
        heads, groups = m.num_attention_heads // tp, m.query_groups // tp
        _require(heads % a2a == 0 and groups % a2a == 0,
                 f"--cp-comm-type {p.cp_comm_type}: the {heads} query heads and {groups} key/value heads of each "
                 f"tensor-parallel rank are not divisible by the all-to-all size {a2a} (--num-attention-heads "
                 f"{m.num_attention_heads}, --num-query-groups {m.query_groups}, --tensor-model-parallel-size {tp})")

    def validate_moe_layout(self) -> None:
        """Expert parallelism's rules (Megatron-LM's): ep divides the experts, and the experts' layout (etp x ep x
        expert-dp) covers the tp x dp ranks of a pipeline stage."""
        m, p = self.model, self.parallel
        tp, ep, dp = p.tensor_model_parallel_size, p.expert_model_parallel_size, self.data_parallel_size
        cp = p.context_parallel_size  # the experts see the tokens of dp x cp (Megatron's expert layout)
        etp = tp if p.expert_tensor_parallel_size is None else p.expert_tensor_parallel_size
        if m.num_experts is None:  # --expert-model-parallel-size declares that it needs --num-experts
            _require(etp == tp, f"--expert-tensor-parallel-size {etp} needs --num-experts")
            return
        _require(m.num_experts % ep == 0,
                 f"--num-experts {m.num_experts} is not divisible by --expert-model-parallel-size {ep}")
        _require((tp * cp * dp) % (etp * ep) == 0,
                 f"--expert-model-parallel-size {ep} * --expert-tensor-parallel-size {etp} does not divide "
                 f"--tensor-model-parallel-size {tp} * " + (f"--context-parallel-size {cp} * " if cp > 1 else "")
                 + f"the data-parallel size {dp} (world size {self.world_size} / pp {p.pipeline_model_parallel_size}); "
                 "the experts' layout splits the ranks of a pipeline stage")
        _require(etp == tp or tp == 1 or p.sequence_parallel,
                 f"--expert-tensor-parallel-size {etp} other than --tensor-model-parallel-size {tp} needs "
                 "--sequence-parallel (each tp rank sends its own sequence shard to the experts)")
        _require(m.moe_ffn_size % etp == 0,
                 f"--moe-ffn-hidden-size {m.moe_ffn_size} is not divisible by --expert-tensor-parallel-size {etp}")
        shared = m.moe_shared_expert_intermediate_size
        _require(shared is None or shared % tp == 0,
                 f"--moe-shared-expert-intermediate-size {shared} is not divisible by "
                 f"--tensor-model-parallel-size {tp}")
        # The torch format's files are cut per (tp, pp, ep) rank and know no expert tp (Megatron's neither).
        _require(etp == tp or not self.checkpoint.save or self.checkpoint.ckpt_format == "torch_dist",
                 f"--ckpt-format torch cannot save --expert-tensor-parallel-size {etp} other than "
                 f"--tensor-model-parallel-size {tp}; use --ckpt-format torch_dist")

    def groups(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "world_size"}

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> Config:
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name == "world_size":
                kwargs[f.name] = values.get(f.name, 1)
                continue
            group_cls = _group_classes()[f.name]
            known = {g.name for g in dataclasses.fields(group_cls)}
            group_values = dict(values.get(f.name, {}))
            for (group, old), new in LEGACY_FIELDS.items():
                if group == f.name and old in group_values:
                    group_values.setdefault(new, group_values.pop(old))
            kwargs[f.name] = group_cls(**{k: v for k, v in group_values.items() if k in known})
        return cls(**kwargs)


def _group_classes() -> dict[str, type]:
    hints = typing.get_type_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config) if f.name != "world_size"}


LEGACY_FIELDS = {("model", "layernorm_epsilon"): "norm_epsilon"}
"""Renamed fields: configs saved under the old name (checkpoints) load into the new one."""
