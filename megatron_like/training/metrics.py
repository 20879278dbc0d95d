"""Throughput, FLOPs and the Megatron training log line."""

from __future__ import annotations

from megatron_like.config import Config


def matmul_parameters(config: Config, padded_vocab_size: int) -> int:
    """Parameters that take part in each token's matmuls: the layers' linears plus the output layer (MoE
    layers: the router, the k experts a token visits and the shared expert, i.e. the active parameters)."""
    m = config.model
    h = m.hidden_size
    qkv_out = (m.num_attention_heads + 2 * m.query_groups) * m.head_dim  # fewer K, V heads with GQA
    mlp_matrices = 3 if m.swiglu else 2  # SwiGLU: gate, up and down
    attention = h * qkv_out + m.attention_size * h  # QKV, then heads x head_dim back to h
    dense_mlp = mlp_matrices * h * m.ffn_size
    moe_layers = sum(m.moe_layer_pattern)
    moe_mlp = 0
    if moe_layers:
        shared = m.moe_shared_expert_intermediate_size or 0
        moe_mlp = m.num_experts * h + mlp_matrices * h * (m.moe_router_topk * m.moe_ffn_size + shared)
    return (m.num_layers * attention + (m.num_layers - moe_layers) * dense_mlp + moe_layers * moe_mlp
            + padded_vocab_size * m.hidden_size)


def flops_per_token(config: Config, padded_vocab_size: int) -> float:
    """Training FLOPs per token, forward and backward: ``6 N + 12 L h s`` (docs/design.md §8), ``h`` there the
    attention's width (heads x head_dim: the hidden size unless --kv-channels sets it apart)."""
    m = config.model
    return 6.0 * matmul_parameters(config, padded_vocab_size) + 12.0 * m.num_layers * m.attention_size * m.seq_length


def format_log_line(
    *,
    iteration: int,
    train_iters: int,
    consumed_samples: int,
    elapsed_ms: float,
    tokens_per_second: float,
    tflops_per_device: float,
    learning_rate: float,
    global_batch_size: int,
    losses: dict[str, float],
    loss_scale: float,
    grad_norm: float | None,
    skipped_iterations: int,
    nan_iterations: int,
) -> str:
    """The one-line Megatron training log (docs/design.md §5)."""
    parts = [
        f" iteration {iteration:8d}/{train_iters:8d}",
        f"consumed samples: {consumed_samples:12d}",
        f"elapsed time per iteration (ms): {elapsed_ms:.1f}",
        f"throughput (tokens/s): {tokens_per_second:.1f}",
        f"TFLOP/s per device: {tflops_per_device:.3f}",
        f"learning rate: {learning_rate:.6E}",
        f"global batch size: {global_batch_size:5d}",
    ]
    parts += [f"{name}: {value:.6E}" for name, value in losses.items()]
    parts.append(f"loss scale: {loss_scale:.1f}")
    if grad_norm is not None:
        parts.append(f"grad norm: {grad_norm:.3f}")
    parts.append(f"number of skipped iterations: {skipped_iterations:3d}")
    parts.append(f"number of nan iterations: {nan_iterations:3d}")
    return " | ".join(parts) + " |"
