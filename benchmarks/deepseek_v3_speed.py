"""DeepSeek-V3's speed on one process (issue 27 item 8): an MLA layer's training step against a Llama GQA layer of the
same hidden size, each against its FLOPs, and greedy decoding of a tiny DeepSeek-V3 through our latent cache against
transformers' ``generate`` on the same (converted) weights.

    python benchmarks/deepseek_v3_speed.py                 # both parts
    python benchmarks/deepseek_v3_speed.py --part decode --batch-size 8 --new-tokens 32

Training: one ``TransformerLayer`` (SwiGLU MLP) with MLA (DeepSeek-V3's head shapes halved) and one with grouped-query
attention, both hidden ``--hidden``, forward and backward of ``[s, b, h]``; FLOPs are counted from the shapes (2 per
multiply-add of every matmul, the causal attention's full ``s x s`` products as Megatron counts them, backward twice
the forward). Decode: a random tiny ``DeepseekV3ForCausalLM`` (MLA with YaRN, a dense layer then MoE layers with
sigmoid group routing, a shared expert and an expert bias) converted by ``hf_deepseek_v3`` into our ``GPTModel``;
batch ``--batch-size`` prompts of equal length, ``--new-tokens`` greedy tokens each. Stops with an error unless both
generated the same tokens. Times are medians of ``--repeats`` runs alternating which side goes first, after a warm-up,
on two clocks: wall, and this thread's CPU time (meaningful on a loaded machine). fp32, ``--threads`` threads.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron_like.config import ModelConfig  # noqa: E402
from megatron_like.inference import GenerationParams, generate, hf_deepseek_v3, hf_gpt2  # noqa: E402
from megatron_like.model import GPTModel  # noqa: E402
from megatron_like.model.transformer import TransformerLayer  # noqa: E402
from megatron_like.parallel_state import ParallelState  # noqa: E402


def timed(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median (wall seconds, thread CPU seconds) of ``repeats`` calls of ``fn`` after one warm-up call."""
    fn()
    walls, cpus = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.thread_time()
        fn()
        walls.append(time.perf_counter() - start)
        cpus.append(time.thread_time() - start_cpu)
    return statistics.median(walls), statistics.median(cpus)


# ---------------------------------------------------------------- training step of one layer
def layer_flops(m: ModelConfig, s: int, b: int) -> float:
    """Forward + backward FLOPs of one layer on ``[s, b, h]`` (matmuls only: 3 x the forward's)."""
    h, a = m.hidden_size, m.num_attention_heads
    if m.multi_latent_attention:
        qk, v = m.qk_head_dim + m.qk_pos_emb_head_dim, m.v_head_dim
        q = h * m.q_lora_rank + m.q_lora_rank * a * qk if m.q_lora_rank else h * a * qk
        projections = q + h * (m.kv_lora_rank + m.qk_pos_emb_head_dim) + m.kv_lora_rank * a * (m.qk_head_dim + v)
        projections += a * v * h
        core = s * a * (qk + v)  # per token: q k^T over s keys, probs v
    else:
        d = m.head_dim
        projections = h * (a + 2 * m.query_groups) * d + a * d * h
        core = s * a * 2 * d
    mlp = 3 * h * m.ffn_size
    return 3 * 2 * s * b * (projections + core + mlp)


def layer_step(config: ModelConfig, s: int, b: int) -> Callable[[], None]:
    layer = TransformerLayer(config, ParallelState.single_process(torch.device("cpu")), 0, 1, False, torch.float32)
    x = torch.randn(s, b, config.hidden_size, requires_grad=True)

    def step() -> None:
        layer(x).sum().backward()

    return step


def training_part(args: argparse.Namespace) -> None:
    common = dict(num_layers=1, hidden_size=args.hidden, num_attention_heads=args.heads, seq_length=args.seq_length,
                  hidden_dropout=0.0, attention_dropout=0.0, position_embedding_type="rope", normalization="RMSNorm",
                  swiglu=True, disable_bias_linear=True, ffn_hidden_size=args.ffn)
    mla = ModelConfig(**common, multi_latent_attention=True, q_lora_rank=args.q_lora_rank,
                      kv_lora_rank=args.kv_lora_rank, qk_head_dim=args.qk_head_dim,
                      qk_pos_emb_head_dim=args.qk_pos_emb_head_dim, v_head_dim=args.v_head_dim)
    gqa = ModelConfig(**common, group_query_attention=True, num_query_groups=args.groups)
    s, b = args.seq_length, args.micro_batch_size
    print(f"Layer training step (forward + backward): hidden {args.hidden}, {args.heads} heads, SwiGLU ffn {args.ffn}, "
          f"[s, b] = [{s}, {b}], fp32, {args.threads} thread(s), median of {args.repeats}")
    print("| layer | GFLOP / step | ms / step (wall) | ms / step (CPU) | GFLOP/s (CPU) |")
    print("|---|---:|---:|---:|---:|")
    names = {"MLA (q latent, kv latent)": mla, f"GQA ({args.groups} groups)": gqa}
    results = {}
    for name, config in names.items():
        flops = layer_flops(config, s, b)
        wall, cpu = timed(layer_step(config, s, b), args.repeats)
        results[name] = (flops, cpu)
        print(f"| {name} | {flops / 1e9:.2f} | {wall * 1e3:.1f} | {cpu * 1e3:.1f} | {flops / cpu / 1e9:.1f} |")
    (mla_flops, mla_cpu), (gqa_flops, gqa_cpu) = results.values()
    print(f"MLA / GQA: {mla_cpu / gqa_cpu:.2f}x the CPU time for {mla_flops / gqa_flops:.2f}x the FLOPs")


# ---------------------------------------------------------------- greedy decoding against transformers
def tiny_deepseek(args: argparse.Namespace):
    import transformers

    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(
        hidden_size=args.hidden, num_attention_heads=args.heads, num_key_value_heads=args.heads,
        q_lora_rank=args.q_lora_rank, kv_lora_rank=args.kv_lora_rank, qk_nope_head_dim=args.qk_head_dim,
        qk_rope_head_dim=args.qk_pos_emb_head_dim, v_head_dim=args.v_head_dim, intermediate_size=args.ffn,
        moe_intermediate_size=args.ffn // 4, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
        n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=1, num_hidden_layers=args.layers,
        vocab_size=args.vocab, tie_word_embeddings=False, max_position_embeddings=4 * (args.prompt_length + 64),
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": args.prompt_length + 64, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        num_mtp_layers=0, initializer_range=0.1)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    return model


def converted(hf) -> GPTModel:
    with tempfile.TemporaryDirectory() as directory:
        hf.save_pretrained(directory)
        cfg, state = hf_gpt2.read_hf_dir(directory)
    config = hf_deepseek_v3.model_config_from_hf(cfg, state.keys())
    config = dataclasses.replace(config, seq_length=min(config.seq_length, 4096))
    vocab = cfg["vocab_size"]
    model = GPTModel(config, ParallelState.single_process(torch.device("cpu")), vocab_size=vocab, seed=1)
    model.load_state_dict(hf_deepseek_v3.from_hf_state(state, config, vocab))
    return model.eval()


def decode_part(args: argparse.Namespace) -> None:
    hf = tiny_deepseek(args)
    ours = converted(hf)
    prompts = torch.randint(0, args.vocab, (args.batch_size, args.prompt_length),
                            generator=torch.Generator().manual_seed(1))
    tokens: dict[str, list[list[int]]] = {}

    def run_ours(new: int) -> None:
        out = generate(ours, prompts.tolist(), GenerationParams(max_new_tokens=new), vocab_size=args.vocab)
        tokens["ours"] = [g[0].token_ids for g in out]

    def run_hf(new: int) -> None:
        with torch.inference_mode():
            out = hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        tokens["transformers"] = out[:, args.prompt_length:].tolist()

    sides = {"ours (latent cache, absorbed decode)": run_ours, "transformers generate (DynamicCache)": run_hf}
    total: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
    prefill: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
    for repeat in range(args.repeats):
        for name in (list(sides) if repeat % 2 == 0 else list(reversed(sides))):
            prefill[name].append(timed(lambda fn=sides[name]: fn(1), 1))
            total[name].append(timed(lambda fn=sides[name]: fn(args.new_tokens), 1))
    if tokens["ours"] != tokens["transformers"]:
        raise SystemExit("ours and transformers generated different tokens")
    decoded = args.batch_size * (args.new_tokens - 1)
    print(f"Greedy decode of a tiny DeepSeek-V3: {args.layers} layers (1 dense, {args.layers - 1} MoE of 8 experts, "
          f"top-2 in 2 of 4 groups, 1 shared), hidden {args.hidden}, {args.heads} heads, kv_lora_rank "
          f"{args.kv_lora_rank}; batch {args.batch_size}, prompt {args.prompt_length}, {args.new_tokens} new tokens, "
          f"{args.threads} thread(s), fp32, median of {args.repeats}; same tokens")
    print("| side | decode tokens/s (wall) | decode tokens/CPU-s | prefill wall s |")
    print("|---|---:|---:|---:|")
    rates = {}
    for name in sides:
        rates[name] = [decoded / (statistics.median(t[c] for t in total[name])
                                  - statistics.median(t[c] for t in prefill[name])) for c in (0, 1)]
        print(f"| {name} | {rates[name][0]:.1f} | {rates[name][1]:.1f} | "
              f"{statistics.median(t[0] for t in prefill[name]):.3f} |")
    ours_rate, hf_rate = rates.values()
    print(f"ours / transformers: {ours_rate[0] / hf_rate[0]:.2f}x tokens/s (wall), {ours_rate[1] / hf_rate[1]:.2f}x "
          "(CPU)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=["train", "decode", "both"], default="both")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--groups", type=int, default=4, help="the GQA layer's key/value heads")
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--q-lora-rank", type=int, default=192)
    parser.add_argument("--kv-lora-rank", type=int, default=64)
    parser.add_argument("--qk-head-dim", type=int, default=64)
    parser.add_argument("--qk-pos-emb-head-dim", type=int, default=32)
    parser.add_argument("--v-head-dim", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--prompt-length", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.part in ("train", "both"):
        training_part(args)
    if args.part in ("decode", "both"):
        decode_part(args)


if __name__ == "__main__":
    main()
