"""Typed configuration: the single source of truth for every command-line flag.

Each field of the dataclasses below becomes one Megatron-style flag: ``num_layers`` -> ``--num-layers``.
A boolean that defaults to False becomes a switch (``--sequence-parallel``); one that defaults to True
becomes its negation (``load_optim`` -> ``--no-load-optim``). The docstring under a field is its ``--help``.

Validation happens in :meth:`Config.validate`, before any process group starts, and raises
:class:`ConfigError` with one line naming the flag, the value and the rule.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import math
import os
import sys
import textwrap
import types
import typing
from dataclasses import dataclass, field
from typing import Literal


class ConfigError(ValueError):
    """An invalid flag value or combination; the message is one line meant for the user."""


def flag_name(field_name: str) -> str:
    """``tensor_model_parallel_size`` -> ``--tensor-model-parallel-size``."""
    return "--" + field_name.replace("_", "-")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


# --------------------------------------------------------------------------------------------------
# The configuration groups
# --------------------------------------------------------------------------------------------------


@dataclass
class ModelConfig:
    """Shape of the GPT model and its regularization."""

    num_layers: int = 2
    """Number of transformer layers."""
    hidden_size: int = 64
    """Transformer hidden size h."""
    ffn_hidden_size: int | None = None
    """Hidden size of the MLP; defaults to 4 * hidden size (with --swiglu: 8/3 * hidden size rounded down to a
    multiple of 64, as Megatron-LM)."""
    num_attention_heads: int = 4
    """Number of attention heads."""
    seq_length: int = 32
    """Tokens per training sample."""
    max_position_embeddings: int | None = None
    """Size of the learned position table; defaults to --seq-length."""
    vocab_size: int | None = None
    """Vocabulary size for the mock or null tokenizer (other tokenizers know their own)."""
    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary to a multiple of this times the tensor-parallel size (fast matmuls, even shards)."""
    hidden_dropout: float = 0.1
    """Dropout after the attention and MLP output projections and on the embeddings."""
    attention_dropout: float = 0.1
    """Dropout on the attention probabilities."""
    init_method_std: float = 0.02
    """Standard deviation of the normal weight init (output projections use std / sqrt(2 * num layers))."""
    norm_epsilon: float = 1e-5
    """Epsilon of every LayerNorm or RMSNorm (alias: --layernorm-epsilon)."""
    untie_embeddings_and_output_weights: bool = False
    """Give the output layer its own weight instead of sharing the input embedding."""
    attention_backend: Literal["sdpa", "local", "flash", "fused", "unfused", "auto"] = "sdpa"
    """'sdpa': torch's scaled_dot_product_attention (flash kernels on CPU and GPU, the fastest); 'local':
    explicit q k^T, softmax and v matmuls (easy to read and modify; uses the fused softmax). Megatron-LM's
    names are accepted: 'flash', 'fused' and 'auto' mean sdpa, 'unfused' means local."""
    cpu_gemm_backend: Literal["auto", "mkl", "onednn"] = "auto"
    """fp32 GEMM library of the tensor-parallel linears on CPU (forward and input gradient; weight gradients
    always use MKL): 'mkl' (F.linear), 'onednn', or 'auto' = oneDNN on AMD CPUs for GEMMs of 2^24
    multiply-adds and more, MKL elsewhere (Intel not measured); see tensor_parallel/cpu_gemm.py."""
    # ---- decoder architecture (GPT-2/3 defaults; Llama: rope, RMSNorm, swiglu, GQA, no biases) ----
    position_embedding_type: Literal["learned_absolute", "rope", "none"] = "learned_absolute"
    """Positions: a learned table added to the embeddings, rotary embeddings applied to q and k in every
    layer, or none (--use-rotary-position-embeddings is the legacy spelling of rope)."""
    rotary_base: int = 10000
    """Base of the rotary frequencies (Llama 2: 10000, Llama 3: 500000)."""
    rotary_percent: float = 1.0
    """Fraction of each head's dimensions that rotary embeddings rotate (the rest pass through)."""
    rotary_seq_len_interpolation_factor: float | None = None
    """Linear RoPE scaling (position interpolation; Hugging Face's rope_type "linear"): every rotary angle is
    divided by this factor, as if positions were t / factor. None: off."""
    use_rope_scaling: bool = False
    """Llama 3.1's RoPE scaling (Hugging Face's rope_type "llama3"): rotary frequencies of wavelength above
    --rope-scaling-original-max-position-embeddings / --rope-scaling-low-freq-factor are divided by
    --rope-scaling-factor, those below ... / --rope-scaling-high-freq-factor kept, those between interpolated."""
    rope_scaling_factor: float = 8.0
    """With --use-rope-scaling: the factor (Llama 3.1: 8, Llama 3.2: 32)."""
    rope_scaling_low_freq_factor: float = 1.0
    """With --use-rope-scaling (ours; Megatron-LM fixes it at 1): Llama 3.1's low_freq_factor."""
    rope_scaling_high_freq_factor: float = 4.0
    """With --use-rope-scaling (ours; Megatron-LM fixes it at 4): Llama 3.1's high_freq_factor."""
    rope_scaling_original_max_position_embeddings: int = 8192
    """With --use-rope-scaling (ours; Megatron-LM fixes it at 8192): the pretraining context the scaling
    stretches."""
    window_size: str | None = None
    """Sliding-window attention, Megatron-LM's "LEFT,RIGHT" (flash-attention's convention): each query attends
    to itself and the LEFT keys before it; RIGHT must be 0 (causal). Mistral 7B v0.1's sliding_window 4096 is
    --window-size 4095,0. None (or LEFT -1): full causal attention."""
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    """Normalization of the layer inputs and the final hidden states."""
    swiglu: bool = False
    """SwiGLU MLP: silu(x W_gate) * (x W_up) -> W_down instead of GELU (Llama)."""
    group_query_attention: bool = False
    """Grouped-query attention: --num-query-groups key/value heads shared by the query heads."""
    num_query_groups: int = 1
    """Key/value heads with --group-query-attention (1 is multi-query attention)."""
    disable_bias_linear: bool = False
    """No biases in the attention and MLP linears."""
    add_qkv_bias: bool = False
    """Keep the QKV bias with --disable-bias-linear (Qwen2)."""
    masked_softmax_fusion: bool = True
    """With --attention-backend local: the fused csrc scale+mask+softmax instead of torch.softmax."""
    bias_gelu_fusion: bool = True
    """Fuse the first MLP bias add into the GELU (csrc kernel, forward and backward)."""
    cross_entropy_loss_fusion: bool = True
    """Fused csrc cross entropy that never materializes the softmax (used at tensor-parallel size 1)."""
    recompute_granularity: Literal["full", "selective"] | None = None
    """Activation recomputation: 'full' recomputes whole layers, 'selective' only the attention core."""
    recompute_method: Literal["uniform", "block"] | None = None
    """With full recompute: 'uniform' checkpoints groups of layers, 'block' the first N layers per stage."""
    recompute_num_layers: int | None = None
    """With full recompute: layers per group ('uniform') or layers recomputed per stage ('block')."""
    qat: bool = False
    """Quantization-aware training: fake int8 quantization (per-channel weights, moving-average per-tensor
    activations, straight-through gradients) in every transformer linear; export with
    megatron_like.quantization.export."""
    # ---- mixture of experts (docs/moe.md; expert parallelism is --expert-model-parallel-size) ----
    num_experts: int | None = None
    """Experts of each MoE layer; without it every MLP is dense."""
    moe_router_topk: int = 2
    """Experts each token is routed to."""
    moe_ffn_hidden_size: int | None = None
    """Hidden size of each expert's MLP; defaults to --ffn-hidden-size."""
    moe_layer_freq: str = "1"
    """Which layers are MoE: N (every N-th layer, from layer 0) or a Python list of 0/1 per layer, e.g.
    "([1]*3+[0]*1)*2" (Megatron-LM's forms)."""
    moe_router_load_balancing_type: Literal["aux_loss", "sinkhorn", "none"] = "aux_loss"
    """'aux_loss': the Switch load-balancing loss; 'sinkhorn': route by Sinkhorn-balanced scores (no loss);
    'none': plain top-k."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of the load-balancing loss added to the training loss (Megatron's default 0; 1e-2 is usual)."""
    moe_z_loss_coeff: float | None = None
    """Weight of the router z-loss, mean(logsumexp(logits)^2) (ST-MoE); None disables it."""
    moe_router_pre_softmax: bool = False
    """Softmax over all experts, then top-k (the k probabilities do not sum to 1); default: top-k of the
    logits, then softmax over those k (Mixtral)."""
    moe_token_dispatcher_type: Literal["allgather", "alltoall"] = "allgather"
    """How tokens reach the experts of other expert-parallel ranks: all-gather every token (then
    reduce-scatter the outputs) or all-to-all exactly the routed ones."""
    moe_expert_capacity_factor: float | None = None
    """Each expert takes at most ceil(factor * tokens * topk / experts) tokens of a micro batch; the rest are
    dropped (their expert output is zero). None: no capacity, no dropping."""
    moe_token_drop_policy: Literal["probs", "position"] = "probs"
    """With a capacity: keep each expert's highest-probability tokens, or its first ones in sequence order."""
    moe_pad_expert_input_to_capacity: bool = False
    """With a capacity: every expert gets exactly `capacity` tokens, filled with unrouted tokens of weight 0
    (fixed shapes)."""
    moe_grouped_gemm: bool = False
    """Compute all local experts with one grouped GEMM (megatron_like.kernels.grouped_gemm) instead of a loop."""
    moe_shared_expert_intermediate_size: int | None = None
    """Hidden size of the shared expert every token also passes through (DeepSeek/Qwen MoE); None: none."""

    def validate(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
            value = getattr(self, name)
            _require(value > 0, f"{flag_name(name)} {value} must be positive")
        _require(
            self.hidden_size % self.num_attention_heads == 0,
            f"--hidden-size {self.hidden_size} is not divisible by "
            f"--num-attention-heads {self.num_attention_heads}",
        )
        _require(
            self.max_position_embeddings is None or self.max_position_embeddings >= self.seq_length,
            f"--max-position-embeddings {self.max_position_embeddings} is smaller than "
            f"--seq-length {self.seq_length}",
        )
        for name in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, name)
            _require(0.0 <= value < 1.0, f"{flag_name(name)} {value} must be in [0, 1)")
        self.validate_architecture()
        self.validate_moe()
        if self.cpu_gemm_backend == "onednn":
            from megatron_like.tensor_parallel.cpu_gemm import onednn_available  # torch only when asked

            _require(onednn_available(), "--cpu-gemm-backend onednn: this torch build has no oneDNN; use auto or mkl")
        if self.recompute_granularity == "full":
            _require(
                self.recompute_method is not None,
                "--recompute-granularity full needs --recompute-method uniform or block",
            )
        if self.recompute_method is not None:
            _require(
                self.recompute_granularity == "full",
                f"--recompute-method {self.recompute_method} only applies with --recompute-granularity full",
            )
            _require(
                self.recompute_num_layers is not None and self.recompute_num_layers > 0,
                "--recompute-method needs a positive --recompute-num-layers",
            )

    def validate_architecture(self) -> None:
        """Rules of the decoder-architecture flags (rotary, norms, grouped-query attention)."""
        _require(0.0 < self.rotary_percent <= 1.0, f"--rotary-percent {self.rotary_percent} must be in (0, 1]")
        _require(self.rotary_base > 0, f"--rotary-base {self.rotary_base} must be positive")
        _require(self.norm_epsilon > 0, f"--norm-epsilon {self.norm_epsilon} must be positive")
        if self.position_embedding_type == "rope":
            rotary_dim = int(self.head_dim * self.rotary_percent)
            _require(
                rotary_dim >= 2 and rotary_dim % 2 == 0,
                f"--rotary-percent {self.rotary_percent} of head dimension {self.head_dim} gives {rotary_dim} "
                "rotated dimensions; it must be a positive even number",
            )
        self.validate_rope_scaling()
        parse_window_size(self.window_size)
        if self.group_query_attention:
            _require(self.num_query_groups > 0, f"--num-query-groups {self.num_query_groups} must be positive")
            _require(
                self.num_attention_heads % self.num_query_groups == 0,
                f"--num-attention-heads {self.num_attention_heads} is not divisible by --num-query-groups "
                f"{self.num_query_groups}",
            )
        else:
            _require(
                self.num_query_groups == 1,
                f"--num-query-groups {self.num_query_groups} needs --group-query-attention",
            )
        _require(
            not self.add_qkv_bias or self.disable_bias_linear,
            "--add-qkv-bias only matters with --disable-bias-linear (the QKV linear has a bias already)",
        )

    def validate_rope_scaling(self) -> None:
        """Rules of --use-rope-scaling and --rotary-seq-len-interpolation-factor."""
        linear = self.rotary_seq_len_interpolation_factor
        if not (self.use_rope_scaling or linear is not None):
            return
        _require(self.position_embedding_type == "rope", "RoPE scaling needs --position-embedding-type rope")
        _require(not (self.use_rope_scaling and linear is not None),
                 "--use-rope-scaling and --rotary-seq-len-interpolation-factor are two RoPE scalings: pick one")
        _require(linear is None or linear > 0, f"--rotary-seq-len-interpolation-factor {linear} must be positive")
        if self.use_rope_scaling:
            _require(self.rope_scaling_factor > 0, f"--rope-scaling-factor {self.rope_scaling_factor} must be positive")
            _require(0 < self.rope_scaling_low_freq_factor < self.rope_scaling_high_freq_factor,
                     f"--rope-scaling-low-freq-factor {self.rope_scaling_low_freq_factor} must be positive and "
                     f"below --rope-scaling-high-freq-factor {self.rope_scaling_high_freq_factor}")
            _require(self.rope_scaling_original_max_position_embeddings > 0,
                     f"--rope-scaling-original-max-position-embeddings "
                     f"{self.rope_scaling_original_max_position_embeddings} must be positive")

    def validate_moe(self) -> None:
        """Rules of the mixture-of-experts flags that need no layout (the layout rules are in Config.validate)."""
        if self.num_experts is None:
            for name in ("moe_ffn_hidden_size", "moe_expert_capacity_factor", "moe_shared_expert_intermediate_size"):
                _require(getattr(self, name) is None, f"{flag_name(name)} needs --num-experts")
            _require(not self.moe_grouped_gemm, "--moe-grouped-gemm needs --num-experts")
            return
        e, k = self.num_experts, self.moe_router_topk
        _require(e >= 1, f"--num-experts {e} must be positive")
        _require(1 <= k <= e, f"--moe-router-topk {k} must be in [1, --num-experts {e}]")
        _require(self.disable_bias_linear, "--num-experts needs --disable-bias-linear (experts hold bias-free "
                 "[experts, in, out] weights, as Megatron-LM's GroupedMLP)")
        for name in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
            value = getattr(self, name)
            _require(value is None or value > 0, f"{flag_name(name)} {value} must be positive")
        _require(self.moe_aux_loss_coeff >= 0, f"--moe-aux-loss-coeff {self.moe_aux_loss_coeff} must be >= 0")
        _require(self.moe_z_loss_coeff is None or self.moe_z_loss_coeff >= 0,
                 f"--moe-z-loss-coeff {self.moe_z_loss_coeff} must be >= 0")
        cf = self.moe_expert_capacity_factor
        _require(cf is None or cf > 0, f"--moe-expert-capacity-factor {cf} must be positive")
        _require(not self.moe_pad_expert_input_to_capacity or cf is not None,
                 "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
        _require(self.moe_router_load_balancing_type != "sinkhorn" or not self.moe_router_pre_softmax,
                 "--moe-router-pre-softmax does not apply to --moe-router-load-balancing-type sinkhorn")
        pattern = self.moe_layer_pattern  # raises ConfigError on a malformed --moe-layer-freq
        _require(len(pattern) == self.num_layers,
                 f"--moe-layer-freq {self.moe_layer_freq} gives {len(pattern)} layers but --num-layers is "
                 f"{self.num_layers}")

    @property
    def moe_layer_pattern(self) -> list[bool]:
        """Per layer: is it an MoE layer? (All False without --num-experts.)"""
        if self.num_experts is None:
            return [False] * self.num_layers
        return parse_moe_layer_freq(self.moe_layer_freq, self.num_layers)

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe_layer_pattern[layer]

    @property
    def moe_ffn_size(self) -> int:
        """Hidden size of each expert's MLP."""
        return self.moe_ffn_hidden_size or self.ffn_size

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        if self.swiglu:  # Megatron-LM: keep the parameters of the 4h GELU MLP, in multiples of 64
            return int((4 * self.hidden_size * 2 / 3) / 64) * 64
        return 4 * self.hidden_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        """Key/value heads: --num-query-groups with --group-query-attention, else one per query head."""
        return self.num_query_groups if self.group_query_attention else self.num_attention_heads

    @property
    def attention_core(self) -> str:
        """Our attention implementation behind --attention-backend: 'sdpa' or 'local'."""
        return "local" if self.attention_backend in ("local", "unfused") else "sdpa"

    @property
    def linear_bias(self) -> bool:
        return not self.disable_bias_linear

    @property
    def qkv_bias(self) -> bool:
        return not self.disable_bias_linear or self.add_qkv_bias

    @property
    def attention_window(self) -> int | None:
        """Keys each query attends to under --window-size, itself included (LEFT + 1); None: no window."""
        return parse_window_size(self.window_size)

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings or self.seq_length


def parse_window_size(value: str | None) -> int | None:
    """--window-size "LEFT,RIGHT" (Megatron-LM's, flash-attention's convention) -> keys per query (LEFT + 1),
    None without a window (no flag, or LEFT -1)."""
    if value is None:
        return None
    try:
        left, right = (int(part) for part in value.strip("()").split(","))
    except ValueError:
        raise ConfigError(f"--window-size {value!r} must be two integers LEFT,RIGHT such as 4095,0") from None
    _require(right == 0, f"--window-size {value}: RIGHT must be 0 (a causal model attends to no later key)")
    _require(left >= -1, f"--window-size {value}: LEFT must be -1 (no window) or at least 0")
    return None if left == -1 else left + 1


def parse_moe_layer_freq(value: str, num_layers: int) -> list[bool]:
    """``--moe-layer-freq``: ``"2"`` -> every 2nd layer from layer 0 is MoE; ``"[1,0,1,1]"`` or
    ``"([1]*3+[0]*1)*2"`` -> one 0/1 per layer. Only list/int literals, ``+`` and ``*`` are evaluated."""

    def evaluate(node: ast.AST) -> object:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.List):
            return [evaluate(e) for e in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = evaluate(node.left), evaluate(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ConfigError(f"--moe-layer-freq {value!r} must be an integer or a list expression of 0/1 such as "
                          "'([1]*3+[0]*1)*2'")

    try:
        parsed = evaluate(ast.parse(value.strip(), mode="eval").body)
    except (SyntaxError, TypeError):
        parsed = None
    if isinstance(parsed, int) and parsed > 0:
        return [layer % parsed == 0 for layer in range(num_layers)]
    if isinstance(parsed, list) and parsed and all(v in (0, 1) for v in parsed):
        return [bool(v) for v in parsed]
    raise ConfigError(f"--moe-layer-freq {value!r} must be a positive integer or a list of 0/1 per layer")


@dataclass
class ParallelConfig:
    """How the model and the batch are split across processes."""

    tensor_model_parallel_size: int = 1
    """Processes that split each layer's matmuls (Megatron tensor parallelism)."""
    pipeline_model_parallel_size: int = 1
    """Pipeline stages that split the layers."""
    num_layers_per_virtual_pipeline_stage: int | None = None
    """Layers per model chunk for the interleaved 1F1B schedule (several chunks per pipeline rank)."""
    sequence_parallel: bool = False
    """Shard LayerNorm and dropout activations along the sequence inside the tensor-parallel group."""
    expert_model_parallel_size: int = 1
    """Processes that split the experts of each MoE layer; an expert-parallel group is ep consecutive ranks of
    a data-parallel group (Megatron-LM's layout, docs/moe.md)."""
    expert_tensor_parallel_size: int | None = None
    """Tensor parallelism inside each expert (default --tensor-model-parallel-size); the experts' own layout
    etp x ep x expert-dp covers the tp x dp ranks of a stage (Megatron-core's expert rank generator)."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state across data-parallel ranks (same as --zero-stage 1)."""
    zero_stage: int = 0
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
    distributed_timeout_minutes: float = 10.0
    """A collective that waits longer than this fails, so a dead rank stops the job instead of hanging it."""

    def validate(self) -> None:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size"):
            value = getattr(self, name)
            _require(value >= 1, f"{flag_name(name)} {value} must be at least 1")
        _require(self.zero_stage in (0, 1, 2, 3), f"--zero-stage {self.zero_stage} must be 0, 1, 2 or 3")
        _require(
            self.distributed_timeout_minutes > 0,
            f"--distributed-timeout-minutes {self.distributed_timeout_minutes} must be positive",
        )
        if self.use_distributed_optimizer and self.zero_stage == 0:
            self.zero_stage = 1  # Megatron's name for ZeRO-1
        _require(not self.overlap_param_gather or self.zero_stage >= 1,
                 "--overlap-param-gather needs --zero-stage 1, 2 or 3 (or --use-distributed-optimizer): "
                 "without ZeRO no parameters are gathered")


@dataclass
class OptimizerConfig:
    """AdamW, its learning-rate schedule and gradient clipping."""

    lr: float = 1e-4
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "linear"
    """Shape of the decay after warmup."""
    lr_decay_iters: int | None = None
    """Iterations over which the learning rate decays; defaults to --train-iters."""
    lr_warmup_iters: int = 0
    """Iterations of linear warmup from 0 to --lr."""
    lr_warmup_fraction: float | None = None
    """Warmup as a fraction of --lr-decay-iters (overrides --lr-warmup-iters)."""
    weight_decay: float = 0.01
    """Decoupled weight decay (not applied to biases and LayerNorm parameters)."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this value (0 disables)."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""

    def validate(self) -> None:
        _require(self.lr >= 0, f"--lr {self.lr} must be non-negative")
        _require(0 <= self.min_lr <= self.lr, f"--min-lr {self.min_lr} must be in [0, --lr {self.lr}]")
        _require(self.clip_grad >= 0, f"--clip-grad {self.clip_grad} must be non-negative")
        _require(self.lr_warmup_iters >= 0, f"--lr-warmup-iters {self.lr_warmup_iters} must be >= 0")
        if self.lr_warmup_fraction is not None:
            _require(
                0 <= self.lr_warmup_fraction <= 1,
                f"--lr-warmup-fraction {self.lr_warmup_fraction} must be in [0, 1]",
            )
        for name in ("adam_beta1", "adam_beta2"):
            value = getattr(self, name)
            _require(0 <= value < 1, f"{flag_name(name)} {value} must be in [0, 1)")


@dataclass
class PrecisionConfig:
    """Parameter/activation dtype and fp16 loss scaling."""

    fp16: bool = False
    """Half-precision (fp16) parameters and activations with fp32 master weights and loss scaling."""
    bf16: bool = False
    """bfloat16 parameters and activations with fp32 master weights."""
    loss_scale: float | None = None
    """Static fp16 loss scale; without it the scale is dynamic."""
    initial_loss_scale: float = 2.0**32
    """First dynamic loss scale."""
    min_loss_scale: float = 1.0
    """The dynamic loss scale never backs off below this."""
    loss_scale_window: int = 1000
    """Clean iterations before the dynamic loss scale doubles."""
    hysteresis: int = 2
    """Overflowing iterations tolerated before the dynamic loss scale halves."""

    def validate(self) -> None:
        _require(not (self.fp16 and self.bf16), "--fp16 and --bf16 are exclusive: pick one")
        if self.loss_scale is not None:
            _require(self.loss_scale > 0, f"--loss-scale {self.loss_scale} must be positive")
        _require(self.loss_scale_window > 0, f"--loss-scale-window {self.loss_scale_window} must be > 0")
        _require(self.hysteresis > 0, f"--hysteresis {self.hysteresis} must be positive")


@dataclass
class DataConfig:
    """Where training samples come from and how text becomes tokens."""

    data_path: list[str] = field(default_factory=list)
    """Dataset prefixes, optionally weighted: 'pathA' or '0.3 pathA 0.7 pathB'."""
    split: str = "969,30,1"
    """Train/validation/test proportions of the documents."""
    mock_data: bool = False
    """Train on deterministic synthetic tokens (needs --vocab-size); no files are read."""
    tokenizer_type: Literal["GPT2BPETokenizer", "HuggingFaceTokenizer", "NullTokenizer"] | None = None
    """Tokenizer; defaults to NullTokenizer with --mock-data, else GPT2BPETokenizer."""
    vocab_file: str | None = None
    """GPT-2 vocabulary (encoder.json); defaults to the original GPT-2 file."""
    merge_file: str | None = None
    """GPT-2 merges (vocab.bpe); defaults to the original GPT-2 file."""
    tokenizer_model: str | None = None
    """tokenizer.json for the HuggingFaceTokenizer."""
    data_cache_path: str | None = None
    """Directory for the cached sample indices; defaults to beside the data."""
    num_workers: int = 2
    """Data loader worker processes."""
    eod_mask_loss: bool = False
    """Do not train on the prediction made at an end-of-document token (the next document's first token)."""

    def validate(self) -> None:
        _require(
            self.mock_data or self.data_path,
            "no training data: pass --data-path PREFIX (see data_tools/preprocess.py) or --mock-data",
        )
        parts = self.split.replace("/", ",").split(",")
        try:
            weights = [float(p) for p in parts]
        except ValueError:
            raise ConfigError(f"--split {self.split!r} must be comma-separated numbers like 969,30,1") from None
        _require(
            len(weights) <= 3 and all(w >= 0 for w in weights) and sum(weights) > 0,
            f"--split {self.split!r} needs up to three non-negative numbers with a positive sum",
        )
        _require(self.num_workers >= 0, f"--num-workers {self.num_workers} must be >= 0")


@dataclass
class TrainingConfig:
    """Batch sizes, length of the run and the seed."""

    micro_batch_size: int = 2
    """Samples per forward/backward pass on one data-parallel rank."""
    global_batch_size: int | None = None
    """Samples per optimizer step across all data-parallel ranks; defaults to micro batch * dp."""
    train_iters: int = 10
    """Optimizer steps to run."""
    seed: int = 1234
    """Seed of weights, dropout and data order; runs with the same seed are identical."""

    def validate(self) -> None:
        _require(self.micro_batch_size > 0, f"--micro-batch-size {self.micro_batch_size} must be positive")
        _require(self.train_iters >= 0, f"--train-iters {self.train_iters} must be >= 0")


@dataclass
class CheckpointConfig:
    """Saving, resuming and leaving a run early."""

    save: str | None = None
    """Directory to save checkpoints to."""
    load: str | None = None
    """Directory to resume from (its latest_checkpointed_iteration.txt)."""
    save_interval: int | None = None
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
    async_save: bool = False
    """torch_dist only: copy the state to host memory, then write it in a background thread while training
    goes on; the next save and the end of training wait for it."""
    exit_interval: int | None = None
    """Save and exit when the iteration is a multiple of this."""
    exit_duration_in_mins: float | None = None
    """Save and exit after this many minutes of training."""
    exit_signal_handler: bool = True
    """On SIGTERM or SIGUSR1 save a checkpoint (with --save) and exit cleanly (--no-exit-signal-handler: die)."""
    override_opt_param_scheduler: bool = False
    """On resume, take the lr schedule (--lr, --min-lr, warmup, decay) from this run's flags, not the
    checkpoint's (the default here; Megatron's default refuses a mismatch). Also --override-opt_param-scheduler."""
    use_checkpoint_opt_param_scheduler: bool = False
    """On resume, keep the checkpoint's lr schedule and ignore this run's lr flags. Also
    --use-checkpoint-opt_param-scheduler."""

    def validate(self) -> None:
        if self.save_interval is not None:
            _require(self.save_interval > 0, f"--save-interval {self.save_interval} must be positive")
        _require(not (self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler),
                 "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler exclude each other: "
                 "pass one (this run's lr flags, or the checkpoint's schedule)")
        _require(not self.async_save or self.ckpt_format == "torch_dist",
                 "--async-save writes torch_dist checkpoints only; drop --ckpt-format torch")


@dataclass
class LoggingConfig:
    """What is printed and recorded during training."""

    log_interval: int = 100
    """Print the training log line every this many iterations."""
    eval_interval: int = 1000
    """Evaluate on the validation split every this many iterations."""
    eval_iters: int = 100
    """Batches per validation run (0 disables evaluation)."""
    tensorboard_dir: str | None = None
    """Write TensorBoard scalars here."""
    wandb_project: str | None = None
    """Also log to this Weights & Biases project (needs the wandb package)."""
    wandb_exp_name: str | None = None
    """Name of the Weights & Biases run (default: chosen by wandb)."""
    log_memory: bool = True
    """Add this rank's peak memory to the log line (--no-log-memory drops it)."""

    def validate(self) -> None:
        _require(self.log_interval > 0, f"--log-interval {self.log_interval} must be positive")
        _require(self.eval_interval > 0, f"--eval-interval {self.eval_interval} must be positive")
        _require(self.eval_iters >= 0, f"--eval-iters {self.eval_iters} must be >= 0")


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
    world_size: int = 1
    """Number of processes, taken from the launcher (WORLD_SIZE)."""

    # ---------------------------------------------------------------- derived sizes
    @property
    def data_parallel_size(self) -> int:
        p = self.parallel
        return self.world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size)

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.training.micro_batch_size * self.data_parallel_size)

    @property
    def global_batch_size(self) -> int:
        t = self.training
        return t.global_batch_size or t.micro_batch_size * self.data_parallel_size

    @property
    def virtual_pipeline_size(self) -> int:
        """Model chunks per pipeline rank (1 without the interleaved schedule)."""
        p = self.parallel
        if p.num_layers_per_virtual_pipeline_stage is None:
            return 1
        return self.model.num_layers // (p.pipeline_model_parallel_size * p.num_layers_per_virtual_pipeline_stage)

    def padded_vocab_size(self, vocab_size: int) -> int:
        """Vocabulary padded to a multiple of --make-vocab-size-divisible-by * tp (Megatron's rule)."""
        multiple = self.model.make_vocab_size_divisible_by * self.parallel.tensor_model_parallel_size
        return int(math.ceil(vocab_size / multiple) * multiple)

    @property
    def params_dtype_name(self) -> str:
        if self.precision.fp16:
            return "float16"
        if self.precision.bf16:
            return "bfloat16"
        return "float32"

    # ---------------------------------------------------------------- validation
    def validate(self) -> Config:
        """Check every group and every cross-group rule; raise ConfigError on the first violation."""
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
        _require(
            self.world_size % (tp * pp) == 0,
            f"world size {self.world_size} is not divisible by --tensor-model-parallel-size {tp} * "
            f"--pipeline-model-parallel-size {pp}; launch a multiple of {tp * pp} processes",
        )
        if p.sequence_parallel:
            _require(
                m.seq_length % tp == 0,
                f"--seq-length {m.seq_length} is not divisible by --tensor-model-parallel-size {tp} "
                "(needed by --sequence-parallel)",
            )
        _require(
            m.num_layers % pp == 0,
            f"--num-layers {m.num_layers} is not divisible by --pipeline-model-parallel-size {pp}",
        )
        if p.num_layers_per_virtual_pipeline_stage is not None:
            v = p.num_layers_per_virtual_pipeline_stage
            _require(v > 0, f"--num-layers-per-virtual-pipeline-stage {v} must be positive")
            _require(pp > 1, "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1")
            _require(
                (m.num_layers // pp) % v == 0,
                f"--num-layers-per-virtual-pipeline-stage {v} does not divide the "
                f"{m.num_layers // pp} layers of each pipeline stage (--num-layers {m.num_layers} / "
                f"--pipeline-model-parallel-size {pp})",
            )
        dp = self.data_parallel_size
        self.validate_moe_layout()
        if t.global_batch_size is not None:
            _require(
                t.global_batch_size % (t.micro_batch_size * dp) == 0,
                f"--global-batch-size {t.global_batch_size} is not divisible by --micro-batch-size "
                f"{t.micro_batch_size} * data-parallel size {dp}",
            )
        if self.virtual_pipeline_size > 1:
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

    def validate_moe_layout(self) -> None:
        """Expert parallelism's rules (Megatron-LM's): ep divides the experts, and the experts' layout (etp x ep x
        expert-dp) covers the tp x dp ranks of a pipeline stage."""
        m, p = self.model, self.parallel
        tp, ep, dp = p.tensor_model_parallel_size, p.expert_model_parallel_size, self.data_parallel_size
        etp = tp if p.expert_tensor_parallel_size is None else p.expert_tensor_parallel_size
        _require(etp >= 1, f"--expert-tensor-parallel-size {etp} must be at least 1")
        if m.num_experts is None:
            _require(ep == 1, f"--expert-model-parallel-size {ep} needs --num-experts")
            _require(etp == tp, f"--expert-tensor-parallel-size {etp} needs --num-experts")
            return
        _require(m.num_experts % ep == 0,
                 f"--num-experts {m.num_experts} is not divisible by --expert-model-parallel-size {ep}")
        _require((tp * dp) % (etp * ep) == 0,
                 f"--expert-model-parallel-size {ep} * --expert-tensor-parallel-size {etp} does not divide "
                 f"--tensor-model-parallel-size {tp} * the data-parallel size {dp} (world size {self.world_size} / "
                 f"pp {p.pipeline_model_parallel_size}); the experts' layout splits the ranks of a pipeline stage")
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


# --------------------------------------------------------------------------------------------------
# Flags generated from the dataclasses
# --------------------------------------------------------------------------------------------------


@functools.cache
def _class_bodies(module_name: str) -> dict[str, list[ast.stmt]]:
    """The statements of each top-level class of a module, by class name, from one parse of its source.

    Parsed once per process: ``inspect.getsource(cls)`` parses the whole file again for every class (~0.14 s of
    CPU per ``build_parser()`` for this file), and every rank of every run parses the command line."""
    tree = ast.parse(inspect.getsource(sys.modules[module_name]))
    return {node.name: node.body for node in tree.body if isinstance(node, ast.ClassDef)}


def field_docstrings(cls: type) -> dict[str, str]:
    """Map each field of a dataclass to the string literal written under it in the source."""
    body = _class_bodies(cls.__module__).get(cls.__qualname__)
    if body is None:  # not a top-level class of its module
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for node, following in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def _unwrap_optional(tp: object) -> object:
    """``int | None`` (or ``Optional[int]``) -> ``int``."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


MEGATRON_SPELLINGS = {
    "override_opt_param_scheduler": "--override-opt_param-scheduler",
    "use_checkpoint_opt_param_scheduler": "--use-checkpoint-opt_param-scheduler",
}
"""Flags Megatron-LM spells with an underscore; both spellings are accepted."""


def _add_group_flags(parser: argparse.ArgumentParser, group_name: str, group_cls: type) -> None:
    arg_group = parser.add_argument_group(group_name, group_cls.__doc__)
    docs = field_docstrings(group_cls)
    hints = typing.get_type_hints(group_cls)
    for f in dataclasses.fields(group_cls):
        tp = _unwrap_optional(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        help_text = docs.get(f.name, "")
        dest = f"{group_name}.{f.name}"
        if tp is bool:
            if default:
                arg_group.add_argument(
                    "--no-" + f.name.replace("_", "-"), dest=dest, action="store_false", help=help_text
                )
                # Also accept the positive form, which some Megatron scripts pass explicitly.
                arg_group.add_argument(flag_name(f.name), dest=dest, action="store_true", help=argparse.SUPPRESS)
            else:
                spellings = [flag_name(f.name)] + ([MEGATRON_SPELLINGS[f.name]] if f.name in MEGATRON_SPELLINGS else [])
                arg_group.add_argument(*spellings, dest=dest, action="store_true", help=help_text)
            parser.set_defaults(**{dest: default})
            continue
        kwargs: dict = {
            "dest": dest,
            "default": default,
            "metavar": f.name.upper(),
            "help": f"{help_text} (default: {default})",
        }
        if typing.get_origin(tp) is Literal:
            kwargs["choices"] = list(typing.get_args(tp))
        elif typing.get_origin(tp) is list:
            kwargs["nargs"] = "+"
            kwargs["type"] = typing.get_args(tp)[0]
        else:
            kwargs["type"] = tp
        arg_group.add_argument(flag_name(f.name), **kwargs)


def _add_legacy_aliases(parser: argparse.ArgumentParser) -> None:
    """Older Megatron-LM spellings that scripts still pass; each sets a field of the dataclasses above."""
    parser.add_argument("--layernorm-epsilon", dest="model.norm_epsilon", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--use-rotary-position-embeddings", dest="model.position_embedding_type",
                        action="store_const", const="rope", help=argparse.SUPPRESS)


LEGACY_FIELDS = {("model", "layernorm_epsilon"): "norm_epsilon"}
"""Renamed fields: configs saved under the old name (checkpoints) load into the new one."""


# ---------------------------------------------------------------- argument errors: one line, printed once


def print_once(message: str) -> None:
    """Print ``message`` to stderr on global rank 0 only (every rank of a launch parses the same flags)."""
    if os.environ.get("RANK", "0") == "0":
        print(message, file=sys.stderr, flush=True)


class QuietArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad command line prints one line (rank 0) with a ``--help`` hint, not the usage."""

    def error(self, message: str) -> typing.NoReturn:
        print_once(f"error: {message} (see {self.prog} --help)")
        raise SystemExit(2)


def no_effect_warnings(config: Config) -> list[str]:
    """Flags that change nothing in this layout: one line each (warnings, as Megatron: the run is valid)."""
    p, warnings = config.parallel, []
    if p.sequence_parallel and p.tensor_model_parallel_size == 1:
        warnings.append("--sequence-parallel has no effect with --tensor-model-parallel-size 1")
    if p.overlap_grad_reduce and config.data_parallel_size == 1:
        warnings.append("--overlap-grad-reduce has no effect with one data-parallel rank (no gradient reduction)")
    if p.overlap_param_gather and config.data_parallel_size == 1:
        warnings.append("--overlap-param-gather has no effect with one data-parallel rank (no parameter gather)")
    if config.checkpoint.save_interval and not config.checkpoint.save:
        warnings.append("--save-interval has no effect without --save")
    m = config.model
    etp_is_tp = p.expert_tensor_parallel_size in (None, p.tensor_model_parallel_size)  # else tokens move over etp
    if m.num_experts is not None and p.expert_model_parallel_size == 1 and etp_is_tp \
            and m.moe_token_dispatcher_type == "alltoall":
        warnings.append("--moe-token-dispatcher-type alltoall has no effect with --expert-model-parallel-size 1")
    if config.data.eod_mask_loss and config.data.mock_data:
        warnings.append("--eod-mask-loss has no effect with --mock-data (its tokens have no end-of-document id)")
    return warnings


def build_parser(description: str = "Megatron-style GPT pretraining") -> argparse.ArgumentParser:
    """An argparse parser with one flag per config field (Megatron-LM's names)."""
    parser = QuietArgumentParser(description=description, allow_abbrev=False)
    for group_name, group_cls in _group_classes().items():
        _add_group_flags(parser, group_name, group_cls)
    _add_legacy_aliases(parser)
    return parser


def config_from_namespace(namespace: argparse.Namespace, world_size: int) -> Config:
    values: dict[str, dict] = {}
    for dest, value in vars(namespace).items():
        if "." in dest:
            group, name = dest.split(".", 1)
            values.setdefault(group, {})[name] = value
    config = Config.from_dict(values)
    config.world_size = world_size
    return config


def parse_config(argv: list[str] | None = None, world_size: int | None = None) -> Config:
    """Parse and validate the command line; the world size comes from the launcher's WORLD_SIZE."""
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    namespace = build_parser().parse_args(argv)
    return config_from_namespace(namespace, world_size).validate()


def parse_config_or_exit(
    argv: list[str] | None = None, extra_check: typing.Callable[[Config], None] | None = None
) -> Config:
    """Like parse_config (then ``extra_check``, e.g. an entry point's own rules), but a ConfigError prints
    one line and exits with status 2 (no traceback)."""
    try:
        config = parse_config(argv)
        if extra_check is not None:
            extra_check(config)
    except ConfigError as error:
        print_once(f"error: {error}")
        raise SystemExit(2) from None
    for warning in no_effect_warnings(config):
        print_once(f"warning: {warning}")
    return config
