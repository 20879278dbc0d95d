"""ModelConfig: the shape of the GPT model (architecture, regularization, recompute, mixture of experts),
its own rules, and the parser of ``--moe-layer-freq``'s layer pattern."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Literal

from megatron_like.config.errors import ConfigError, _require, flag_name


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
    init_method_xavier_uniform: bool = False
    """Draw every weight matrix of the transformer layers Xavier-uniform over its full (unsplit) shape, output
    projections included (no depth scaling), instead of N(0, --init-method-std^2); embeddings and heads keep
    --init-method-std. pretrain_vit.py's default (the original ViT's init); see docs/workflows.md."""
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
        _require(not self.init_method_xavier_uniform, "--init-method-xavier-uniform is not supported with "
                 "--num-experts (the experts draw N(0, --init-method-std^2)); drop one of the two")
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
