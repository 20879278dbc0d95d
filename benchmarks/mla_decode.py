"""Multi-latent attention decoding: the compressed-latent cache with absorbed up-projections against caching full
keys and values (``GenerationParams(cache_latent=False)``), on the same weights.

    python benchmarks/mla_decode.py                     # 4 layers, hidden 512, 16 heads, DeepSeek-V3's head shapes / 2
    python benchmarks/mla_decode.py --batch-size 8 --prompt-length 512 --new-tokens 32 --threads 1

One process, fp32, random weights. Reports the cache bytes per token (all layers, measured from the buffers the
cache allocated) and greedy decode tokens/s on two clocks: wall time and this thread's CPU time (``time.thread_time``,
which stays meaningful on a loaded machine where wall time also counts other processes' turns on the core). Each is
the median of ``--repeats`` runs alternating which path goes first, after a warm-up; the prefill of the prompt is
timed separately and subtracted. Stops with an error unless both paths generated the same tokens.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron_like.config import ModelConfig  # noqa: E402
from megatron_like.inference import GenerationParams, generate  # noqa: E402
from megatron_like.inference.kv_cache import KVCache  # noqa: E402
from megatron_like.model import GPTModel  # noqa: E402
from megatron_like.parallel_state import ParallelState  # noqa: E402


def build_model(args: argparse.Namespace) -> GPTModel:
    config = ModelConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        seq_length=args.prompt_length + args.new_tokens, hidden_dropout=0.0, attention_dropout=0.0,
        vocab_size=args.vocab, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
        disable_bias_linear=True, untie_embeddings_and_output_weights=True, multi_latent_attention=True,
        q_lora_rank=args.q_lora_rank, kv_lora_rank=args.kv_lora_rank, qk_head_dim=args.qk_head_dim,
        qk_pos_emb_head_dim=args.qk_pos_emb_head_dim, v_head_dim=args.v_head_dim,
    )
    return GPTModel(config, ParallelState.single_process(torch.device("cpu")), vocab_size=args.vocab, seed=1).eval()


def cache_bytes_per_token(model: GPTModel, cache_latent: bool) -> int:
    cache = KVCache(1, 4, cache_latent=cache_latent)
    with torch.inference_mode():
        model(torch.zeros(1, 4, dtype=torch.long), torch.arange(4)[None], inference_context=cache)
    return cache.bytes_per_token()


def timed_generate(model: GPTModel, prompts: list[list[int]], new_tokens: int, cache_latent: bool
                   ) -> tuple[tuple[float, float], list[list[int]]]:
    """((wall seconds, thread CPU seconds), the generated tokens)."""
    start, start_cpu = time.perf_counter(), time.thread_time()
    out = generate(model, prompts, GenerationParams(max_new_tokens=new_tokens, cache_latent=cache_latent))
    return (time.perf_counter() - start, time.thread_time() - start_cpu), [g[0].token_ids for g in out]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--q-lora-rank", type=int, default=192)
    parser.add_argument("--kv-lora-rank", type=int, default=64)
    parser.add_argument("--qk-head-dim", type=int, default=64)
    parser.add_argument("--qk-pos-emb-head-dim", type=int, default=32)
    parser.add_argument("--v-head-dim", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--prompt-length", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = build_model(args)
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, args.vocab, (args.batch_size, args.prompt_length), generator=generator).tolist()
    paths = {"latent, absorbed": True, "full keys/values": False}
    timed_generate(model, prompts, 2, True), timed_generate(model, prompts, 2, False)  # warm-up
    prefill: dict[str, list[tuple[float, float]]] = {name: [] for name in paths}
    total: dict[str, list[tuple[float, float]]] = {name: [] for name in paths}
    tokens = {}
    for repeat in range(args.repeats):
        order = list(paths) if repeat % 2 == 0 else list(reversed(paths))
        for name in order:
            prefill[name].append(timed_generate(model, prompts, 1, paths[name])[0])
            seconds, tokens[name] = timed_generate(model, prompts, args.new_tokens, paths[name])
            total[name].append(seconds)
    if tokens["latent, absorbed"] != tokens["full keys/values"]:
        raise SystemExit("the two caches generated different tokens")
    decoded = args.batch_size * (args.new_tokens - 1)  # the first new token comes from the prefill
    print(f"MLA decode: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, kv_lora_rank "
          f"{args.kv_lora_rank}, rope {args.qk_pos_emb_head_dim}, nope {args.qk_head_dim}, v {args.v_head_dim}; "
          f"batch {args.batch_size}, prompt {args.prompt_length}, {args.new_tokens} new tokens, "
          f"{args.threads} thread(s), fp32, median of {args.repeats}")
    print("| path | cache bytes/token | decode tokens/s (wall) | decode tokens/CPU-s | prefill wall s |")
    print("|---|---:|---:|---:|---:|")
    rates: dict[str, list[float]] = {}
    for name, cache_latent in paths.items():
        rates[name] = []
        for clock in (0, 1):
            seconds = statistics.median(t[clock] for t in total[name]) - statistics.median(
                t[clock] for t in prefill[name])
            rates[name].append(decoded / seconds)
        print(f"| {name} | {cache_bytes_per_token(model, cache_latent)} | {rates[name][0]:.1f} | "
              f"{rates[name][1]:.1f} | {statistics.median(t[0] for t in prefill[name]):.3f} |")
    wall, cpu = (rates["latent, absorbed"][c] / rates["full keys/values"][c] for c in (0, 1))
    bytes_ratio = cache_bytes_per_token(model, False) / cache_bytes_per_token(model, True)
    print(f"latent / full: decode {wall:.2f}x tokens/s (wall), {cpu:.2f}x (CPU); cache {bytes_ratio:.1f}x smaller; "
          "same tokens")


if __name__ == "__main__":
    main()
