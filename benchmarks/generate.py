"""Greedy generation throughput: our KV-cache generation vs Hugging Face ``generate`` on the same weights.

    python benchmarks/generate.py                      # GPT 6L/512/8 heads, GPT-2 vocabulary
    python benchmarks/generate.py --batch-sizes 1 8 --new-tokens 128 --threads 2
    python benchmarks/generate.py --llama --batch-sizes 8   # Llama style vs LlamaForCausalLM

One process, fp32, the model built once with random weights and converted to a ``GPT2LMHeadModel``
with ``megatron_like.inference.hf_gpt2`` (``--llama``: a Llama-style model, 2 query groups, ffn 1408,
vocabulary 32000, converted to a ``LlamaForCausalLM`` with ``hf_llama``; so both run identical weights); both
generate greedily with their KV cache for exactly ``--new-tokens`` tokens after a ``--prompt-length`` prompt.
Each side runs ``--repeats`` times after a short warm-up, in one process, rotating which side goes first, and
the *median* counts. Two clocks: wall time (tokens/s, what a user sees) and this thread's CPU time
(``time.thread_time``: the work each side does, which stays meaningful on a loaded machine where wall time
also counts the time other processes held the core). "ours" multiplies by weights prepacked for the
batch's row count (``megatron_like.inference.packed_linear``, as tools/generate.py and the server do);
"ours, F.linear" is the same generation without it. Prints a table with tokens/s and the ratios
(ours / HF), and stops with an error unless all three generated the same tokens.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron_like.config import ModelConfig  # noqa: E402
from megatron_like.inference import GenerationParams, generate, hf_gpt2, hf_llama  # noqa: E402
from megatron_like.inference.packed_linear import pack_linears, unpack_linears  # noqa: E402
from megatron_like.model import GPTModel  # noqa: E402
from megatron_like.model.state import gather_full_state  # noqa: E402
from megatron_like.parallel_state import ParallelState  # noqa: E402

LLAMA = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, ffn_hidden_size=1408,
             group_query_attention=True, num_query_groups=2, disable_bias_linear=True,
             untie_embeddings_and_output_weights=True)


def build_models(layers: int, hidden: int, heads: int, vocab: int, positions: int, llama: bool = False):
    """(our model, the HF GPT2LMHeadModel or LlamaForCausalLM holding the same weights)."""
    import transformers

    config = ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, seq_length=positions,
                         hidden_dropout=0.0, attention_dropout=0.0, vocab_size=vocab, **(LLAMA if llama else {}))
    config.validate()
    padded = -(-vocab // 128) * 128
    ours = GPTModel(config, ParallelState.single_process(torch.device("cpu")), vocab_size=padded, seed=1).eval()
    family = hf_llama if llama else hf_gpt2
    config_cls, model_cls = ("LlamaConfig", "LlamaForCausalLM") if llama else ("GPT2Config", "GPT2LMHeadModel")
    hf_cfg = getattr(transformers, config_cls)(**family.hf_config(config, vocab))
    hf = getattr(transformers, model_cls)(hf_cfg).eval()
    state = family.to_hf_state(gather_full_state([ours]), config, vocab)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    hf.tie_weights()
    return ours, hf


def run_ours(model, prompts: torch.Tensor, new_tokens: int, vocab: int) -> tuple[float, float, list[list[int]]]:
    """(wall seconds, CPU seconds of this thread, generated ids) of our greedy generation."""
    params = GenerationParams(max_new_tokens=new_tokens)
    start, cpu = time.perf_counter(), time.thread_time()
    out = generate(model, prompts.tolist(), params, eod=None, vocab_size=vocab)
    return time.perf_counter() - start, time.thread_time() - cpu, [seqs[0].token_ids for seqs in out]


@torch.inference_mode()
def run_hf(hf, prompts: torch.Tensor, new_tokens: int) -> tuple[float, float, list[list[int]]]:
    """(wall seconds, CPU seconds of this thread, generated ids) of ``hf.generate``, greedy."""
    start, cpu = time.perf_counter(), time.thread_time()
    out = hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                      min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return time.perf_counter() - start, time.thread_time() - cpu, out[:, prompts.shape[1]:].tolist()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-layers", type=int, default=6)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--vocab-size", type=int, default=None, help="default 50257 (GPT-2), 32000 (--llama)")
    parser.add_argument("--llama", action="store_true", help="Llama-style model vs LlamaForCausalLM")
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--threads", type=int, default=1,
                        help="torch.set_num_threads; 1 by default: on a shared 2-core machine more threads "
                             "than free cores make OpenMP spin and both sides' times meaningless")
    parser.add_argument("--repeats", type=int, default=5, help="Rotating runs per side; the median counts.")
    args = parser.parse_args(argv)
    args.vocab_size = args.vocab_size or (32000 if args.llama else 50257)
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    positions = max(1024, args.prompt_length + args.new_tokens)
    ours, hf = build_models(args.num_layers, args.hidden_size, args.num_attention_heads, args.vocab_size, positions,
                            args.llama)
    gen = torch.Generator().manual_seed(0)
    warm = torch.randint(0, args.vocab_size, (1, args.prompt_length), generator=gen)
    run_ours(ours, warm, 4, args.vocab_size)
    run_hf(hf, warm, 4)

    family = "Llama-style (2 groups, ffn 1408)" if args.llama else "GPT"
    print(f"# greedy generation, {family} {args.num_layers}L/{args.hidden_size}h/{args.num_attention_heads} heads, "
          f"vocabulary {args.vocab_size}, prompt {args.prompt_length} + {args.new_tokens} new tokens, fp32")
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__} "
          f"({torch.get_num_threads()} threads), transformers {transformers.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"# {args.repeats} runs per side, order rotated, medians; load average before: {os.getloadavg()[0]:.1f}")
    print("| batch | ours tokens/s | ours, F.linear tokens/s | HF generate tokens/s | ratio (wall) | "
          "ratio (CPU time) | same tokens |")
    print("|---:|---:|---:|---:|---:|---:|:---:|")
    for batch in args.batch_sizes:
        prompts = torch.randint(0, args.vocab_size, (batch, args.prompt_length), generator=gen)
        wall: dict[str, list[float]] = {"packed": [], "plain": [], "hf": []}
        cpu: dict[str, list[float]] = {"packed": [], "plain": [], "hf": []}
        ids = {}
        for repeat in range(args.repeats):  # rotate the order so a load spike does not hit one side only
            sides = ["packed", "plain", "hf"]
            for side in sides[repeat % 3:] + sides[: repeat % 3]:
                if side == "hf":
                    t, c, out = run_hf(hf, prompts, args.new_tokens)
                else:
                    if side == "packed":
                        pack_linears([ours], batch)
                    else:
                        unpack_linears([ours])
                    t, c, out = run_ours(ours, prompts, args.new_tokens, args.vocab_size)
                if ids.setdefault(side, out) != out:
                    raise SystemExit(f"batch {batch}: {side} generated other tokens than in its first run")
                wall[side].append(t)
                cpu[side].append(c)
        unpack_linears([ours])
        if not ids["packed"] == ids["plain"] == ids["hf"]:
            raise SystemExit(f"batch {batch}: ours, ours with F.linear and HF generate produced different tokens")
        tokens = batch * args.new_tokens
        med = {side: (statistics.median(wall[side]), statistics.median(cpu[side])) for side in wall}
        print(f"| {batch} | {tokens / med['packed'][0]:.1f} | {tokens / med['plain'][0]:.1f} | "
              f"{tokens / med['hf'][0]:.1f} | {med['hf'][0] / med['packed'][0]:.2f}x | "
              f"{med['hf'][1] / med['packed'][1]:.2f}x | yes |", flush=True)
    print(f"# load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
