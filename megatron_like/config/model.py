"""ModelConfig: the shape of the GPT model (architecture, regularization, recompute, mixture of experts),
its own rules, and the parser of ``--moe-layer-freq``'s layer pattern."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Annotated, Literal

from megatron_like.config.errors import ConfigError, _require
from megatron_like.config.fields import (
    FINETUNE_MAY_CHANGE,
    MAY_CHANGE,
    MUST_MATCH,
    NON_NEGATIVE,
    POSITIVE,
    PROBABILITY,
    NotCompared,
    Range,
    Requires,
)

NEEDS_EXPERTS = Requires("num_experts")
NEEDS_ROPE = Requires("position_embedding_type", "rope")
NEEDS_ROPE_SCALING = Requires("use_rope_scaling")
NEEDS_MLA = Requires("multi_latent_attention")
NEEDS_YARN = Requires("rope_type", "yarn")
# Why a field is not compared with a checkpoint (``fields.NotCompared``):
SAME_MATH = "an implementation choice: every choice computes the same function"
FUSED = "a fused kernel of the same formula"
RECOMPUTE = "recomputation trades memory for compute; the results are the same"
VOCAB_REASON = ("sets the vocabulary rows, which the load compares as the embedding's shape (the tokenizer's size "
                "counts, not the flag)")


@dataclass
class ModelConfig:
    """Shape of the GPT model and its regularization."""

    num_layers: Annotated[int, MUST_MATCH, POSITIVE] = 2
    """Number of transformer layers."""
    hidden_size: Annotated[int, MUST_MATCH, POSITIVE] = 64
    """Transformer hidden size h."""
    ffn_hidden_size: Annotated[int | None, MUST_MATCH.through("ffn_size"), POSITIVE] = None
    """Hidden size of the MLP; defaults to 4 * hidden size (with --swiglu: 8/3 * hidden size rounded down to a
    multiple of 64, as Megatron-LM)."""
    num_attention_heads: Annotated[int, MUST_MATCH, POSITIVE] = 4
    """Number of attention heads."""
    kv_channels: Annotated[int | None, MUST_MATCH.through("head_dim"), POSITIVE] = None
    """Dimension of each query, key and value head; defaults to --hidden-size / --num-attention-heads. Qwen3 sets
    it apart from them (128 with hidden 2048 and 32 heads): the attention works in heads x kv-channels features
    and its output projection maps them back to the hidden size."""
    seq_length: Annotated[int, MAY_CHANGE, POSITIVE] = 32
    """Tokens per training sample."""
    max_position_embeddings: Annotated[int | None, FINETUNE_MAY_CHANGE.through("max_positions"), POSITIVE] = None
    """Size of the learned position table; defaults to --seq-length."""
    vocab_size: Annotated[int | None, NotCompared(VOCAB_REASON), POSITIVE] = None
    """Vocabulary size for the mock or null tokenizer (other tokenizers know their own)."""
    make_vocab_size_divisible_by: Annotated[int, NotCompared(VOCAB_REASON), POSITIVE] = 128
    """Pad the vocabulary to a multiple of this times the tensor-parallel size (fast matmuls, even shards)."""
    hidden_dropout: Annotated[float, MAY_CHANGE, PROBABILITY] = 0.1
    """Dropout after the attention and MLP output projections and on the embeddings."""
    attention_dropout: Annotated[float, MAY_CHANGE, PROBABILITY] = 0.1
    """Dropout on the attention probabilities."""
    dropout_rng: Annotated[Literal["megatron", "layout-independent"], MAY_CHANGE] = "megatron"
    """Where dropout masks come from. megatron: Megatron-LM's streams (the default generator per pipeline stage,
    shared by the tp ranks; a per-tp-rank stream for attention heads and sequence shards), so each layout draws
    other masks. layout-independent: one stream per site (the embedding, each layer's residual dropout and
    attention, per global head), seeded by --seed and the site's name, so every tp x pp layout drops what one
    process drops; attention then runs head by head (model/dropout.py). pretrain_vit.py's and
    finetune_gpt_classification.py's default."""
    init_method_std: Annotated[float, NotCompared("initialization only: loaded weights replace it"), POSITIVE] = 0.02
    """Standard deviation of the normal weight init (output projections use std / sqrt(2 * num layers))."""
    init_method_xavier_uniform: Annotated[bool, NotCompared("initialization only: loaded weights replace it")] = False
    """Draw every weight matrix of the transformer layers Xavier-uniform over its full (unsplit) shape, output
    projections included (no depth scaling), instead of N(0, --init-method-std^2); embeddings and heads keep
    --init-method-std. pretrain_vit.py's default (the original ViT's init); see docs/workflows.md."""
    norm_epsilon: Annotated[float, MUST_MATCH, POSITIVE] = 1e-5
    """Epsilon of every LayerNorm or RMSNorm (alias: --layernorm-epsilon)."""
    untie_embeddings_and_output_weights: Annotated[bool, MUST_MATCH] = False
    """Give the output layer its own weight instead of sharing the input embedding."""
    attention_backend: Annotated[Literal["sdpa", "local", "flash", "fused", "unfused", "auto"],
                                 NotCompared(SAME_MATH)] = "sdpa"
    """'sdpa': torch's scaled_dot_product_attention (flash kernels on CPU and GPU, the fastest); 'local':
    explicit q k^T, softmax and v matmuls (easy to read and modify; uses the fused softmax). Megatron-LM's
    names are accepted: 'flash', 'fused' and 'auto' mean sdpa, 'unfused' means local."""
    cpu_gemm_backend: Annotated[Literal["auto", "mkl", "onednn"], NotCompared(SAME_MATH)] = "auto"
    """fp32 GEMM library of the tensor-parallel linears on CPU (forward and input gradient; weight gradients
    always use MKL): 'mkl' (F.linear), 'onednn', or 'auto' = oneDNN on AMD CPUs for GEMMs of 2^24
    multiply-adds and more, MKL elsewhere (Intel not measured); see tensor_parallel/cpu_gemm.py."""
    # ---- decoder architecture (GPT-2/3 defaults; Llama: rope, RMSNorm, swiglu, GQA, no biases) ----
    position_embedding_type: Annotated[Literal["learned_absolute", "rope", "none"], MUST_MATCH] = "learned_absolute"
    """Positions: a learned table added to the embeddings, rotary embeddings applied to q and k in every
    layer, or none (--use-rotary-position-embeddings is the legacy spelling of rope)."""
    rotary_base: Annotated[int, FINETUNE_MAY_CHANGE, POSITIVE, NEEDS_ROPE] = 10000
    """Base of the rotary frequencies (Llama 2: 10000, Llama 3: 500000)."""
    rotary_percent: Annotated[float, MUST_MATCH, Range(0, 1, min_open=True), NEEDS_ROPE] = 1.0
    """Fraction of each head's dimensions that rotary embeddings rotate (the rest pass through)."""
    rotary_seq_len_interpolation_factor: Annotated[float | None, FINETUNE_MAY_CHANGE, POSITIVE, NEEDS_ROPE] = None
    """Linear RoPE scaling (position interpolation; Hugging Face's rope_type "linear"): every rotary angle is
    divided by this factor, as if positions were t / factor. None: off."""
    use_rope_scaling: Annotated[bool, FINETUNE_MAY_CHANGE, NEEDS_ROPE] = False
    """Llama 3.1's RoPE scaling (Hugging Face's rope_type "llama3"): rotary frequencies of wavelength above
    --rope-scaling-original-max-position-embeddings / --rope-scaling-low-freq-factor are divided by
    --rope-scaling-factor, those below ... / --rope-scaling-high-freq-factor kept, those between interpolated."""
    rope_scaling_factor: Annotated[float, FINETUNE_MAY_CHANGE, POSITIVE, NEEDS_ROPE_SCALING] = 8.0
    """With --use-rope-scaling: the factor (Llama 3.1: 8, Llama 3.2: 32)."""
    rope_scaling_low_freq_factor: Annotated[float, FINETUNE_MAY_CHANGE, POSITIVE, NEEDS_ROPE_SCALING] = 1.0
    """With --use-rope-scaling (ours; Megatron-LM fixes it at 1): Llama 3.1's low_freq_factor."""
    rope_scaling_high_freq_factor: Annotated[float, FINETUNE_MAY_CHANGE, POSITIVE, NEEDS_ROPE_SCALING] = 4.0
    """With --use-rope-scaling (ours; Megatron-LM fixes it at 4): Llama 3.1's high_freq_factor."""
    rope_scaling_original_max_position_embeddings: Annotated[int, FINETUNE_MAY_CHANGE, POSITIVE,
                                                             NEEDS_ROPE_SCALING] = 8192
    """With --use-rope-scaling (ours; Megatron-LM fixes it at 8192): the pretraining context the scaling
    stretches."""
    window_size: Annotated[str | None, FINETUNE_MAY_CHANGE.through("attention_window")] = None
    """Sliding-window attention, Megatron-LM's "LEFT,RIGHT" (flash-attention's convention): each query attends
    to itself and the LEFT keys before it; RIGHT must be 0 (causal). Mistral 7B v0.1's sliding_window 4096 is
    --window-size 4095,0. None (or LEFT -1): full causal attention."""
    normalization: Annotated[Literal["LayerNorm", "RMSNorm"], MUST_MATCH] = "LayerNorm"
    """Normalization of the layer inputs and the final hidden states."""
    swiglu: Annotated[bool, MUST_MATCH] = False
    """SwiGLU MLP: silu(x W_gate) * (x W_up) -> W_down instead of GELU (Llama)."""
    group_query_attention: Annotated[bool, MUST_MATCH.through("query_groups")] = False
    """Grouped-query attention: --num-query-groups key/value heads shared by the query heads."""
    num_query_groups: Annotated[int, MUST_MATCH.through("query_groups"), POSITIVE,
                                Requires("group_query_attention")] = 1
    """Key/value heads with --group-query-attention (1 is multi-query attention)."""
    disable_bias_linear: Annotated[bool, MUST_MATCH.through("linear_bias")] = False
    """No biases in the attention and MLP linears."""
    add_qkv_bias: Annotated[bool, MUST_MATCH.through("qkv_bias"), Requires("disable_bias_linear")] = False
    """Keep the QKV bias with --disable-bias-linear (Qwen2)."""
    qk_layernorm: Annotated[bool, MUST_MATCH] = False
    """Normalize every query and key head (--normalization over --kv-channels features, with one weight of that
    size for all query heads and one for all key heads) before the rotary embeddings (Qwen3)."""
    masked_softmax_fusion: Annotated[bool, NotCompared(FUSED)] = True
    """With --attention-backend local: the fused csrc scale+mask+softmax instead of torch.softmax."""
    bias_gelu_fusion: Annotated[bool, NotCompared(FUSED)] = True
    """Fuse the first MLP bias add into the GELU (csrc kernel, forward and backward)."""
    cross_entropy_loss_fusion: Annotated[bool, NotCompared(FUSED)] = True
    """Fused csrc cross entropy that never materializes the softmax (used at tensor-parallel size 1)."""
    recompute_granularity: Annotated[Literal["full", "selective"] | None, NotCompared(RECOMPUTE)] = None
    """Activation recomputation: 'full' recomputes whole layers, 'selective' only the attention core."""
    recompute_method: Annotated[Literal["uniform", "block"] | None, NotCompared(RECOMPUTE),
                                Requires("recompute_granularity", "full")] = None
    """With full recompute: 'uniform' checkpoints groups of layers, 'block' the first N layers per stage."""
    recompute_num_layers: Annotated[int | None, NotCompared(RECOMPUTE), POSITIVE, Requires("recompute_method")] = None
    """With full recompute: layers per group ('uniform') or layers recomputed per stage ('block')."""
    qat: Annotated[bool, FINETUNE_MAY_CHANGE] = False
    """Quantization-aware training: fake int8 quantization (per-channel weights, moving-average per-tensor
    activations, straight-through gradients) in every transformer linear; export with
    megatron_like.quantization.export."""
    # ---- multi-latent attention (DeepSeek-V2/V3; docs/models.md, model/multi_latent_attention.py) ----
    multi_latent_attention: Annotated[bool, MUST_MATCH, NEEDS_ROPE, Requires("disable_bias_linear")] = False
    """Multi-latent attention (MLA) instead of multi-head attention: queries and keys/values through low-rank
    latents, RoPE on a separate slice of each head shared by all heads for keys (DeepSeek-V2/V3)."""
    q_lora_rank: Annotated[int | None, MUST_MATCH, POSITIVE, NEEDS_MLA] = None
    """With MLA: rank of the query latent (DeepSeek-V3: 1536; RMSNorm on the latent); None: queries through one
    plain projection (DeepSeek-V2-Lite)."""
    kv_lora_rank: Annotated[int, MUST_MATCH, POSITIVE, NEEDS_MLA] = 32
    """With MLA: rank of the key/value latent, what generation caches per token (DeepSeek-V3: 512)."""
    qk_head_dim: Annotated[int, MUST_MATCH, POSITIVE, NEEDS_MLA] = 128
    """With MLA: per-head query/key dimensions without positions (DeepSeek-V3: 128)."""
    qk_pos_emb_head_dim: Annotated[int, MUST_MATCH, POSITIVE, NEEDS_MLA] = 64
    """With MLA: per-head query/key dimensions that RoPE rotates; the key's is one slice shared by all heads
    (DeepSeek-V3: 64)."""
    v_head_dim: Annotated[int, MUST_MATCH, POSITIVE, NEEDS_MLA] = 128
    """With MLA: per-head value dimensions (DeepSeek-V3: 128)."""
    rope_type: Annotated[Literal["rope", "yarn"], FINETUNE_MAY_CHANGE, NEEDS_MLA] = "rope"
    """With MLA: 'rope' (plain rotary, or --use-rope-scaling's), or 'yarn': YaRN scaling (Peng et al. 2023) of the
    rotary frequencies with its attention-scale correction (mscale)."""
    rotary_scaling_factor: Annotated[float, FINETUNE_MAY_CHANGE, Range(1), NEEDS_YARN] = 40.0
    """With --rope-type yarn: the context extension factor (DeepSeek-V3: 40)."""
    original_max_position_embeddings: Annotated[int, FINETUNE_MAY_CHANGE, POSITIVE, NEEDS_YARN] = 4096
    """With --rope-type yarn: the pretraining context the factor stretches (DeepSeek-V3: 4096)."""
    beta_fast: Annotated[float, FINETUNE_MAY_CHANGE, POSITIVE, NEEDS_YARN] = 32.0
    """With --rope-type yarn: frequencies turning more than this many times over the original context keep
    their value."""
    beta_slow: Annotated[float, FINETUNE_MAY_CHANGE, POSITIVE, NEEDS_YARN] = 1.0
    """With --rope-type yarn: frequencies turning fewer times than this are divided by the factor (between the
    two: a linear ramp)."""
    mscale: Annotated[float, FINETUNE_MAY_CHANGE, NON_NEGATIVE, NEEDS_YARN] = 1.0
    """With --rope-type yarn: the rotary tables are multiplied by m(mscale) / m(mscale_all_dim), where
    m(x) = 0.1 x ln(factor) + 1."""
    mscale_all_dim: Annotated[float, FINETUNE_MAY_CHANGE, NON_NEGATIVE, NEEDS_YARN] = 0.0
    """With --rope-type yarn: the softmax scale is multiplied by m(mscale_all_dim)^2 (DeepSeek-V3: 1.0; 0: no
    correction)."""
    # ---- mixture of experts (docs/moe.md; expert parallelism is --expert-model-parallel-size) ----
    num_experts: Annotated[int | None, MUST_MATCH, POSITIVE] = None
    """Experts of each MoE layer; without it every MLP is dense."""
    moe_router_topk: Annotated[int, MUST_MATCH, POSITIVE, NEEDS_EXPERTS] = 2
    """Experts each token is routed to."""
    moe_ffn_hidden_size: Annotated[int | None, MUST_MATCH.through("moe_ffn_size"), POSITIVE, NEEDS_EXPERTS] = None
    """Hidden size of each expert's MLP; defaults to --ffn-hidden-size."""
    moe_layer_freq: Annotated[str, MUST_MATCH.through("moe_layer_pattern"), NEEDS_EXPERTS] = "1"
    """Which layers are MoE: N (every N-th layer, from layer 0) or a Python list of 0/1 per layer, e.g.
    "([1]*3+[0]*1)*2" (Megatron-LM's forms)."""
    moe_router_load_balancing_type: Annotated[Literal["aux_loss", "sinkhorn", "none", "seq_aux_loss"],
                                              MUST_MATCH.through("moe_sinkhorn_routing"), NEEDS_EXPERTS] = "aux_loss"
    """'aux_loss': the Switch load-balancing loss over the micro batch; 'seq_aux_loss': the same loss per
    sequence, averaged over the sequences (DeepSeek-V2/V3); 'sinkhorn': route by Sinkhorn-balanced scores (no
    loss); 'none': plain top-k."""
    moe_aux_loss_coeff: Annotated[float, MAY_CHANGE, NON_NEGATIVE, NEEDS_EXPERTS] = 0.0
    """Weight of the load-balancing loss added to the training loss (Megatron's default 0; 1e-2 is usual)."""
    moe_z_loss_coeff: Annotated[float | None, MAY_CHANGE, NON_NEGATIVE, NEEDS_EXPERTS] = None
    """Weight of the router z-loss, mean(logsumexp(logits)^2) (ST-MoE); None disables it."""
    moe_router_pre_softmax: Annotated[bool, MUST_MATCH, NEEDS_EXPERTS] = False
    """Softmax over all experts, then top-k (the k probabilities do not sum to 1); default: top-k of the
    logits, then softmax over those k (Mixtral)."""
    moe_router_score_function: Annotated[Literal["softmax", "sigmoid"], MUST_MATCH, NEEDS_EXPERTS] = "softmax"
    """How logits become scores: 'softmax' (Mixtral, Qwen) or 'sigmoid' of each logit (DeepSeek-V3), whose k
    chosen scores are then divided by their sum (with k > 1)."""
    moe_router_num_groups: Annotated[int | None, MUST_MATCH, POSITIVE, NEEDS_EXPERTS,
                                     Requires("moe_router_group_topk")] = None
    """Group-limited routing (DeepSeek-V3's node-limited routing): the experts in this many equal groups of
    consecutive experts; each token picks --moe-router-group-topk groups, then its top-k inside them."""
    moe_router_group_topk: Annotated[int | None, MUST_MATCH, POSITIVE, NEEDS_EXPERTS,
                                     Requires("moe_router_num_groups")] = None
    """Groups each token may route to: those whose two best scores sum highest (DeepSeek-V3)."""
    moe_router_topk_scaling_factor: Annotated[float | None, MUST_MATCH, POSITIVE, NEEDS_EXPERTS] = None
    """Multiply the k routing weights by this factor (DeepSeek-V3's routed_scaling_factor, 2.5); None: 1."""
    moe_router_enable_expert_bias: Annotated[bool, FINETUNE_MAY_CHANGE, NEEDS_EXPERTS,
                                             Requires("moe_router_score_function", "sigmoid")] = False
    """Auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias, added to the scores for choosing the
    experts only, moves after every optimizer step by --moe-router-bias-update-rate towards the experts that got
    fewer tokens than the mean (a buffer, not a parameter; saved in checkpoints)."""
    moe_router_bias_update_rate: Annotated[float, MAY_CHANGE, NON_NEGATIVE,
                                           Requires("moe_router_enable_expert_bias")] = 1e-3
    """Step of the expert bias per optimizer step: + rate for an expert below the mean load, - rate above."""
    moe_token_dispatcher_type: Annotated[Literal["allgather", "alltoall"], NotCompared(
        "how tokens travel between expert-parallel ranks; the experts compute the same"), NEEDS_EXPERTS] = "allgather"
    """How tokens reach the experts of other expert-parallel ranks: all-gather every token (then
    reduce-scatter the outputs) or all-to-all exactly the routed ones."""
    moe_expert_capacity_factor: Annotated[float | None, FINETUNE_MAY_CHANGE, POSITIVE, NEEDS_EXPERTS] = None
    """Each expert takes at most ceil(factor * tokens * topk / experts) tokens of a micro batch; the rest are
    dropped (their expert output is zero). None: no capacity, no dropping."""
    moe_token_drop_policy: Annotated[Literal["probs", "position"], FINETUNE_MAY_CHANGE, NEEDS_EXPERTS,
                                     Requires("moe_expert_capacity_factor")] = "probs"
    """With a capacity: keep each expert's highest-probability tokens, or its first ones in sequence order."""
    moe_pad_expert_input_to_capacity: Annotated[bool, NotCompared("the padding tokens have weight 0: same outputs"),
                                                NEEDS_EXPERTS, Requires("moe_expert_capacity_factor")] = False
    """With a capacity: every expert gets exactly `capacity` tokens, filled with unrouted tokens of weight 0
    (fixed shapes)."""
    moe_grouped_gemm: Annotated[bool, NotCompared(SAME_MATH), NEEDS_EXPERTS] = False
    """Compute all local experts with one grouped GEMM (megatron_like.kernels.grouped_gemm) instead of a loop."""
    moe_shared_expert_intermediate_size: Annotated[int | None, MUST_MATCH, POSITIVE, NEEDS_EXPERTS] = None
    """Hidden size of the shared expert every token also passes through (DeepSeek/Qwen MoE); None: none."""
    # ---- multi-token prediction (DeepSeek-V3; docs/models.md) ----
    mtp_num_layers: Annotated[int | None, MUST_MATCH, POSITIVE] = None
    """Multi-token prediction depths on the last pipeline stage: depth k (1..N) predicts token t+k+1 from depth
    k-1's hidden state and the embedding of token t+k, with its own transformer layer and the model's embedding
    and output layer. None: off."""
    mtp_loss_scaling_factor: Annotated[float, MAY_CHANGE, NON_NEGATIVE, Requires("mtp_num_layers")] = 0.1
    """Weight of the MTP losses: factor / --mtp-num-layers times the sum of the depths' losses is added to the LM
    loss (Megatron-LM's default 0.1)."""

    def validate(self) -> None:
        """The rules between fields (each field's range and the flags it needs are declared on it: fields.py)."""
        _require(
            self.kv_channels is not None or self.hidden_size % self.num_attention_heads == 0,
            f"--hidden-size {self.hidden_size} is not divisible by "
            f"--num-attention-heads {self.num_attention_heads} (or give the head size with --kv-channels)",
        )
        _require(
            self.max_position_embeddings is None or self.max_position_embeddings >= self.seq_length,
            f"--max-position-embeddings {self.max_position_embeddings} is smaller than "
            f"--seq-length {self.seq_length}",
        )
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
            _require(self.recompute_num_layers is not None,
                     "--recompute-method needs a positive --recompute-num-layers")

    def validate_architecture(self) -> None:
        """Rules of the decoder-architecture flags (rotary, norms, grouped-query attention)."""
        if self.position_embedding_type == "rope":
            rotary_dim = int(self.head_dim * self.rotary_percent)
            _require(
                rotary_dim >= 2 and rotary_dim % 2 == 0,
                f"--rotary-percent {self.rotary_percent} of head dimension {self.head_dim} gives {rotary_dim} "
                "rotated dimensions; it must be a positive even number",
            )
        self.validate_rope_scaling()
        self.validate_mla()
        parse_window_size(self.window_size)
        if self.group_query_attention:
            _require(
                self.num_attention_heads % self.num_query_groups == 0,
                f"--num-attention-heads {self.num_attention_heads} is not divisible by --num-query-groups "
                f"{self.num_query_groups}",
            )

    def validate_rope_scaling(self) -> None:
        """Rules of --use-rope-scaling and --rotary-seq-len-interpolation-factor."""
        linear = self.rotary_seq_len_interpolation_factor
        if not (self.use_rope_scaling or linear is not None):
            return
        _require(self.position_embedding_type == "rope", "RoPE scaling needs --position-embedding-type rope")
        _require(not (self.use_rope_scaling and linear is not None),
                 "--use-rope-scaling and --rotary-seq-len-interpolation-factor are two RoPE scalings: pick one")
        if self.use_rope_scaling:
            _require(self.rope_scaling_low_freq_factor < self.rope_scaling_high_freq_factor,
                     f"--rope-scaling-low-freq-factor {self.rope_scaling_low_freq_factor} must be below "
                     f"--rope-scaling-high-freq-factor {self.rope_scaling_high_freq_factor}")

    def validate_mla(self) -> None:
        """Rules of --multi-latent-attention (which flags it needs are declared on the fields)."""
        if not self.multi_latent_attention:
            return
        _require(self.qk_pos_emb_head_dim % 2 == 0,
                 f"--qk-pos-emb-head-dim {self.qk_pos_emb_head_dim} must be even (RoPE rotates pairs)")
        _require(self.rotary_percent == 1.0, "--multi-latent-attention rotates the whole --qk-pos-emb-head-dim "
                 "slice: leave --rotary-percent at 1")
        _require(not self.group_query_attention, "--multi-latent-attention shares one latent between all heads: "
                 "drop --group-query-attention")
        _require(self.window_size is None, "--multi-latent-attention has no sliding window: drop --window-size")
        _require(not self.init_method_xavier_uniform, "--multi-latent-attention draws N(0, --init-method-std^2): "
                 "drop --init-method-xavier-uniform")
        _require(self.attention_core == "sdpa", "--multi-latent-attention runs on --attention-backend sdpa")
        _require(not self.qat, "--qat fake-quantizes the tensor-parallel linears only; --multi-latent-attention's "
                 "down-projections are not: drop --qat")
        _require(not (self.rope_type == "yarn" and (self.use_rope_scaling
                                                     or self.rotary_seq_len_interpolation_factor is not None)),
                 "--rope-type yarn is a RoPE scaling of its own: drop --use-rope-scaling and "
                 "--rotary-seq-len-interpolation-factor")

    def validate_moe(self) -> None:
        """Rules of the mixture-of-experts flags that need no layout (the layout rules are in Config.validate)."""
        if self.num_experts is None:  # every MoE flag declares Requires("num_experts")
            return
        e, k = self.num_experts, self.moe_router_topk
        _require(not self.init_method_xavier_uniform, "--init-method-xavier-uniform is not supported with "
                 "--num-experts (the experts draw N(0, --init-method-std^2)); drop one of the two")
        _require(k <= e, f"--moe-router-topk {k} must be in [1, --num-experts {e}]")
        _require(self.disable_bias_linear, "--num-experts needs --disable-bias-linear (experts hold bias-free "
                 "[experts, in, out] weights, as Megatron-LM's GroupedMLP)")
        _require(self.moe_router_load_balancing_type != "sinkhorn" or not self.moe_router_pre_softmax,
                 "--moe-router-pre-softmax does not apply to --moe-router-load-balancing-type sinkhorn")
        self.validate_moe_routing()
        pattern = self.moe_layer_pattern  # raises ConfigError on a malformed --moe-layer-freq
        _require(len(pattern) == self.num_layers,
                 f"--moe-layer-freq {self.moe_layer_freq} gives {len(pattern)} layers but --num-layers is "
                 f"{self.num_layers}")

    def validate_moe_routing(self) -> None:
        """Rules of the DeepSeek routing flags (score function, group-limited top-k)."""
        e, k = self.num_experts, self.moe_router_topk
        sinkhorn = self.moe_router_load_balancing_type == "sinkhorn"
        _require(not (sinkhorn and self.moe_router_score_function == "sigmoid"),
                 "--moe-router-score-function sigmoid does not apply to --moe-router-load-balancing-type sinkhorn "
                 "(Sinkhorn weighs by its own rule)")
        groups, group_topk = self.moe_router_num_groups, self.moe_router_group_topk
        if groups is None:
            return
        _require(not sinkhorn, "--moe-router-num-groups does not apply to --moe-router-load-balancing-type sinkhorn")
        _require(e % groups == 0, f"--num-experts {e} is not divisible by --moe-router-num-groups {groups}")
        _require(group_topk <= groups,
                 f"--moe-router-group-topk {group_topk} must be at most --moe-router-num-groups {groups}")
        _require(k <= group_topk * (e // groups),
                 f"--moe-router-topk {k} is more than the {group_topk * (e // groups)} experts of "
                 f"--moe-router-group-topk {group_topk} groups of {e // groups}")

    @property
    def moe_layer_pattern(self) -> list[bool]:
        """Per layer: is it an MoE layer? (All False without --num-experts.)"""
        if self.num_experts is None:
            return [False] * self.num_layers
        return parse_moe_layer_freq(self.moe_layer_freq, self.num_layers)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer ``layer`` is MoE. Indices from --num-layers on are the MTP depths' layers: they take
        the main model's last layer's kind (Megatron-LM's MTP spec; DeepSeek-V3's MTP layer is MoE)."""
        return self.moe_layer_pattern[min(layer, self.num_layers - 1)]

    @property
    def moe_layers(self) -> list[int]:
        """Global indices of the MoE layers, the MTP depths' (``num_layers + depth``) included."""
        return [layer for layer in range(self.num_layers + (self.mtp_num_layers or 0)) if self.is_moe_layer(layer)]

    @property
    def moe_sinkhorn_routing(self) -> bool:
        """Whether tokens are routed by Sinkhorn-balanced scores (the other balancing types route by plain top-k)."""
        return self.moe_router_load_balancing_type == "sinkhorn"

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
        """Features of each query, key and value head: --kv-channels, by default hidden size / heads."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def attention_size(self) -> int:
        """Features of all query heads together (the attention output projection's input): heads x head_dim."""
        return self.num_attention_heads * self.head_dim

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
