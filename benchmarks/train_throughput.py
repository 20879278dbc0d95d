"""Training throughput of our GPT (tp=1) versus Hugging Face ``GPT2LMHeadModel`` (or, with ``--llama``, our
Llama-style model versus ``LlamaForCausalLM``), in one run.

Same sizes (default: 6 layers, hidden 512, 8 heads, seq 256, micro batch 8, vocab 50304, fp32; ``--llama``:
rope, RMSNorm, SwiGLU with ffn 1408, 2 query groups, no biases, untied output layer, vocab 32000), same
random tokens, same optimizer (torch AdamW, fused), dropout off in both. Trials alternate between the two
models so a slow period of the machine hits both. Each step is timed twice: wall clock (tokens/s) and the
process's CPU time (``time.process_time``, all threads), whose ratio moves less when other jobs share the
cores. Our linears use ``--cpu-gemm-backend`` (default auto: oneDNN on AMD CPUs, see
megatron_like/tensor_parallel/cpu_gemm.py); when that is not MKL, a third side, ours with MKL's GEMM, gives
the like-for-like ratio (HF's ``nn.Linear`` runs on MKL), printed beside the ratio with our GEMMs. MFU is
model FLOPs per second (``6 N + 12 L h s`` per token, LM head included) over the fp32 matmul rate of this
CPU measured in the same run (``torch.mm`` of 2048^3, i.e. MKL), not over a datasheet peak: a GEMM library
faster than MKL on these shapes (oneDNN here) can raise it.

    .venv/bin/python benchmarks/train_throughput.py [--torch-compile] [--llama] [--cpu-gemm-backend B]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from megatron_like.config import Config, ModelConfig
from megatron_like.model import GPTModel
from megatron_like.parallel_state import ParallelState
from megatron_like.tensor_parallel.cpu_gemm import resolve_backend
from megatron_like.training.metrics import flops_per_token


def measure_matmul_rate(size: int = 2048, repeats: int = 10) -> float:
    """fp32 GEMM FLOP/s of this machine right now (best of ``repeats``)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def model_config(args: argparse.Namespace, gemm: str | None = None) -> ModelConfig:
    """Our ModelConfig of the benchmark's shapes (GPT-2 style, or Llama style with ``--llama``)."""
    gemm = gemm or args.cpu_gemm_backend
    config = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                         seq_length=args.seq, hidden_dropout=0.0, attention_dropout=0.0, cpu_gemm_backend=gemm)
    if args.llama:
        config = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                             seq_length=args.seq, hidden_dropout=0.0, attention_dropout=0.0, cpu_gemm_backend=gemm,
                             position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                             ffn_hidden_size=args.ffn, group_query_attention=True, num_query_groups=args.groups,
                             disable_bias_linear=True, untie_embeddings_and_output_weights=True)
    config.validate()
    return config


def build_ours(args: argparse.Namespace, gemm: str | None = None) -> tuple[torch.nn.Module, callable]:
    model = GPTModel(model_config(args, gemm), ParallelState.single_process(), vocab_size=args.vocab, seed=1234)
    positions = torch.arange(args.seq).unsqueeze(0).expand(args.micro_batch, args.seq)

    def loss_fn(m: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        return m(tokens[:, :-1], positions, labels=tokens[:, 1:]).mean()

    return model, loss_fn


def build_hf(args: argparse.Namespace) -> tuple[torch.nn.Module, callable]:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    if args.llama:
        cls, config = LlamaForCausalLM, LlamaConfig(
            vocab_size=args.vocab, max_position_embeddings=args.seq, hidden_size=args.hidden,
            num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.groups,
            intermediate_size=args.ffn, rms_norm_eps=1e-5, tie_word_embeddings=False)
    else:
        cls, config = GPT2LMHeadModel, GPT2Config(
            vocab_size=args.vocab, n_positions=args.seq, n_embd=args.hidden, n_layer=args.layers,
            n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = cls(config, attn_implementation="sdpa") if _accepts_attn(cls) else cls(config)

    def loss_fn(m: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        # HF shifts the labels itself: feed the same seq tokens as ours and let it predict the next ones.
        return m(input_ids=tokens[:, :-1], labels=tokens[:, :-1]).loss

    return model, loss_fn


def _accepts_attn(cls: type) -> bool:
    try:
        import inspect

        return "attn_implementation" in inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return False


def make_step(model: torch.nn.Module, loss_fn: callable, compile_model: bool):
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    forward = torch.compile(model) if compile_model else model

    def step(tokens: torch.Tensor) -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(forward, tokens)
        loss.backward()
        optimizer.step()
        return float(loss)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=None, help="default 50304 (GPT), 32000 (--llama)")
    parser.add_argument("--llama", action="store_true", help="Llama-style model vs LlamaForCausalLM")
    parser.add_argument("--groups", type=int, default=2, help="query groups (--llama)")
    parser.add_argument("--ffn", type=int, default=1408, help="SwiGLU ffn hidden size (--llama)")
    parser.add_argument("--trials", type=int, default=4, help="timed steps per model")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--torch-compile", action="store_true", help="torch.compile both models")
    parser.add_argument("--cpu-gemm-backend", choices=["auto", "mkl", "onednn"], default="auto",
                        help="our linears' fp32 CPU GEMM (megatron_like/tensor_parallel/cpu_gemm.py)")
    args = parser.parse_args()
    args.vocab = args.vocab or (32000 if args.llama else 50304)
    hf_name = "HF LlamaForCausalLM" if args.llama else "HF GPT2LMHeadModel"

    torch.manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1))
    ours, ours_mkl = f"megatron_like ({args.cpu_gemm_backend} GEMM)", "megatron_like (mkl GEMM)"
    gemm = resolve_backend(args.cpu_gemm_backend)
    models = {ours: build_ours(args), hf_name: build_hf(args)}
    if gemm != "mkl":  # the like-for-like side: HF's linears run on MKL
        models[ours_mkl] = build_ours(args, "mkl")
    steps = {name: make_step(m, fn, args.torch_compile) for name, (m, fn) in models.items()}
    for step in steps.values():
        for _ in range(args.warmup):
            step(tokens)
    times: dict[str, list[float]] = {name: [] for name in steps}
    cpu_times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.trials):
        for name, step in steps.items():
            start, cpu_start = time.perf_counter(), time.process_time()
            step(tokens)
            times[name].append(time.perf_counter() - start)
            cpu_times[name].append(time.process_time() - cpu_start)
    matmul_rate = measure_matmul_rate()

    flops = flops_per_token(Config(model=model_config(args)), args.vocab)
    tokens_per_step = args.micro_batch * args.seq
    hf_rate = tokens_per_step / statistics.median(times[hf_name])
    hf_cpu = statistics.median(cpu_times[hf_name])
    mode = "torch.compile" if args.torch_compile else "eager"
    shape = f" {args.groups} groups ffn {args.ffn} (Llama style)" if args.llama else ""
    print(f"# training step, {args.layers}L h{args.hidden} {args.heads} heads{shape} seq {args.seq} micro batch "
          f"{args.micro_batch} vocab {args.vocab}, fp32 {mode}, {torch.get_num_threads()} threads")
    print(f"# measured fp32 matmul rate of this CPU (torch.mm 2048^3, MKL, best of 10): {matmul_rate / 1e9:.1f} "
          "GFLOP/s; MFU = model FLOP/s over it")
    print("| model | ms/step (median) | tokens/s | GFLOP/s | MFU of measured matmul | speed vs HF | CPU s/step "
          "| CPU-time speed vs HF |")
    print("|---|---|---|---|---|---|---|---|")
    for name, ts in times.items():
        median, cpu = statistics.median(ts), statistics.median(cpu_times[name])
        rate = tokens_per_step / median
        print(f"| {name} | {median * 1000:.0f} | {rate:.0f} | {rate * flops / 1e9:.1f} | "
              f"{rate * flops / matmul_rate:.0%} | {rate / hf_rate:.2f}x | {cpu:.2f} | {hf_cpu / cpu:.2f}x |")

    def versus_hf(name: str) -> str:
        wall = statistics.median(times[hf_name]) / statistics.median(times[name])
        return f"{wall:.2f}x wall, {hf_cpu / statistics.median(cpu_times[name]):.2f}x CPU time"

    like_for_like = ours_mkl if ours_mkl in times else ours
    print(f"# speed vs HF, like for like (both on MKL GEMMs): {versus_hf(like_for_like)}")
    if like_for_like != ours:
        rule = {"onednn": "oneDNN", "auto_onednn": "oneDNN from 2^24 multiply-adds, MKL below"}[gemm]
        print(f"# speed vs HF, ours with --cpu-gemm-backend {args.cpu_gemm_backend} ({rule} on this CPU): "
              f"{versus_hf(ours)}")


if __name__ == "__main__":
    main()
