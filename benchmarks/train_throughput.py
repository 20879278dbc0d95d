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

On a GPU (``--device cuda``, with ``--dtype bf16``) both models hold bf16 weights and run the same fused AdamW;
each step ends with a device synchronize before the clock is read. MFU is then printed twice: over the matmul
rate measured in the same run (``torch.mm`` of 8192^3 in the dtype) and over ``--peak-tflops`` (the card's
datasheet dense rate: 989 for an H100/H200 SXM in bf16).

    .venv/bin/python benchmarks/train_throughput.py [--torch-compile] [--llama] [--cpu-gemm-backend B]
    python3 benchmarks/train_throughput.py --device cuda --dtype bf16 --layers 24 --hidden 1024 --heads 16 \
        --seq 1024 --micro-batch 8
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


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so a wall clock read after it covers that work (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_matmul_rate(size: int = 2048, repeats: int = 10, device: torch.device | None = None,
                        dtype: torch.dtype = torch.float32) -> float:
    """GEMM FLOP/s of this machine (or GPU) right now, in ``dtype`` (best of ``repeats``)."""
    device = device or torch.device("cpu")
    a, b = torch.randn(size, size, device=device, dtype=dtype), torch.randn(size, size, device=device, dtype=dtype)
    torch.mm(a, b)
    synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        synchronize(device)
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
    device = torch.device(args.device)
    model = GPTModel(model_config(args, gemm), ParallelState.single_process(device), vocab_size=args.vocab,
                     seed=1234)
    model.to(device=device, dtype=DTYPES[args.dtype])
    positions = torch.arange(args.seq, device=device).unsqueeze(0).expand(args.micro_batch, args.seq)

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
    model.to(device=torch.device(args.device), dtype=DTYPES[args.dtype])

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


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_step(model: torch.nn.Module, loss_fn: callable, compile_model: bool):
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    forward = torch.compile(model) if compile_model else model

    def step(tokens: torch.Tensor) -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(forward, tokens)
        loss.backward()
        optimizer.step()
        value = float(loss)
        synchronize(next(model.parameters()).device)  # the optimizer's kernels too, not only the loss's
        return value

    return step


def print_profile(name: str, step: callable, tokens: torch.Tensor, rows: int, on_gpu: bool) -> None:
    """One step of ``name`` under torch.profiler: its ``rows`` costliest ops by self time (device time on GPU)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        step(tokens)
    sort_by = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    print(f"# profile of one step: {name}")
    print(prof.key_averages().table(sort_by=sort_by, row_limit=rows, max_name_column_width=60))


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
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="weights and activations")
    parser.add_argument("--profile", type=int, default=0, metavar="ROWS",
                        help="after timing, profile one step of each model and print its top ROWS ops by self time")
    parser.add_argument("--peak-tflops", type=float, default=989.0,
                        help="the GPU's datasheet dense rate in --dtype, for the second MFU (default: H100/H200 bf16)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here; run on a GPU machine or drop --device")
    args.vocab = args.vocab or (32000 if args.llama else 50304)
    hf_name = "HF LlamaForCausalLM" if args.llama else "HF GPT2LMHeadModel"

    torch.manual_seed(0)
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    tokens = torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1)).to(device)
    ours, ours_mkl = f"megatron_like ({args.cpu_gemm_backend} GEMM)", "megatron_like (mkl GEMM)"
    if on_gpu:
        ours = "megatron_like"
    gemm = resolve_backend(args.cpu_gemm_backend)
    models = {ours: build_ours(args), hf_name: build_hf(args)}
    if gemm != "mkl" and not on_gpu:  # the like-for-like side: HF's linears run on MKL
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
    if args.profile:
        for name, step in steps.items():
            print_profile(name, step, tokens, args.profile, on_gpu)
    matmul_size = 8192 if on_gpu else 2048
    matmul_rate = measure_matmul_rate(matmul_size, device=device, dtype=DTYPES[args.dtype])

    flops = flops_per_token(Config(model=model_config(args)), args.vocab)
    tokens_per_step = args.micro_batch * args.seq
    hf_rate = tokens_per_step / statistics.median(times[hf_name])
    hf_cpu = statistics.median(cpu_times[hf_name])
    mode = "torch.compile" if args.torch_compile else "eager"
    shape = f" {args.groups} groups ffn {args.ffn} (Llama style)" if args.llama else ""
    where = f"{torch.cuda.get_device_name(device)}" if on_gpu else f"{torch.get_num_threads()} threads"
    print(f"# training step, {args.layers}L h{args.hidden} {args.heads} heads{shape} seq {args.seq} micro batch "
          f"{args.micro_batch} vocab {args.vocab}, {args.dtype} {mode}, {where}, torch {torch.__version__}")
    print(f"# measured {args.dtype} matmul rate (torch.mm {matmul_size}^3, best of 10): {matmul_rate / 1e12:.2f} "
          "TFLOP/s; MFU = model FLOP/s over it" + (f" and over the datasheet {args.peak_tflops:g}" if on_gpu else ""))
    peak_column = " MFU of datasheet peak |" if on_gpu else ""
    unit, scale = ("TFLOP/s", 1e12) if on_gpu else ("GFLOP/s", 1e9)
    print(f"| model | ms/step (median) | tokens/s | {unit} | MFU of measured matmul |" + peak_column
          + " speed vs HF | CPU s/step | CPU-time speed vs HF |")
    print("|---|---|---|---|---|" + ("---|" if on_gpu else "") + "---|---|---|")
    for name, ts in times.items():
        median, cpu = statistics.median(ts), statistics.median(cpu_times[name])
        rate = tokens_per_step / median
        peak = f" {rate * flops / (args.peak_tflops * 1e12):.1%} |" if on_gpu else ""
        print(f"| {name} | {median * 1000:.1f} | {rate:.0f} | {rate * flops / scale:.1f} | "
              f"{rate * flops / matmul_rate:.1%} |{peak} {rate / hf_rate:.2f}x | {cpu:.2f} | {hf_cpu / cpu:.2f}x |")

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
