"""Fused kernels versus the unfused PyTorch ops they replace, in one process, one table.

    .venv/bin/python benchmarks/kernels.py            # GPT-2-sized shapes, 100M-param Adam
    .venv/bin/python benchmarks/kernels.py --quick    # small shapes, a smoke run
    .venv/bin/python benchmarks/kernels.py --ops rms_norm swiglu rotary --skip-adam   # some sections only

Each row times the same work both ways in this run (interleaved, best of --repeats after a warm-up,
so the machine's 2x speed swings between periods do not leak into a ratio) and prints
speedup = torch time / fused time. "fwd+bwd" includes the forward. The Adam rows compare one optimizer
step on --adam-params fp32 parameters: torch.optim.AdamW foreach and fused=True, and the offload step
(update + bf16 copy of the params) against fused AdamW followed by a separate bf16 copy.
"""

from __future__ import annotations

import argparse
import itertools
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_like.kernels import (  # noqa: E402 - after the path tweak, for runs from a checkout
    adam_step_,
    bias_gelu,
    csrc_available,
    csrc_isa,
    fused_add_layer_norm,
    fused_apply_rotary,
    fused_rms_norm,
    fused_swiglu,
    fused_vocab_cross_entropy,
    layer_norm,
    scaled_masked_softmax,
    scaled_upper_triang_masked_softmax,
)
from megatron_like.model.norms import rms_norm  # noqa: E402 - the references the Llama kernels replace
from megatron_like.model.rotary import apply_rotary, rotary_cos_sin  # noqa: E402
from megatron_like.model.transformer import swiglu  # noqa: E402


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    """Return the fastest of ``repeats`` timed calls in milliseconds, after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def compare(torch_fn: Callable[[], object], fused_fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Return (torch ms, fused ms), timing the two alternately so both see the same machine."""
    torch_ms, fused_ms = float("inf"), float("inf")
    for _ in range(2):
        torch_ms = min(torch_ms, best_ms(torch_fn, repeats))
        fused_ms = min(fused_ms, best_ms(fused_fn, repeats))
    return torch_ms, fused_ms


def fwd_bwd(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> Callable[[], None]:
    """Return a closure running fn(*inputs) forward and backward with a fixed upstream gradient."""
    out = fn(*inputs)
    grad = torch.randn_like(out[0] if isinstance(out, tuple) else out)

    def run() -> None:
        for t in inputs:
            if t.requires_grad:
                t.grad = None
        result = fn(*inputs)
        (result[0] if isinstance(result, tuple) else result).backward(grad)

    return run


def row(name: str, shape: str, dtype: torch.dtype, kind: str, torch_fn, fused_fn, repeats: int) -> tuple:
    """Return one table row: (op, shape, dtype, pass, torch ms, fused ms)."""
    return (name, shape, dtype, kind, *compare(torch_fn, fused_fn, repeats))


def softmax_rows(dtype: torch.dtype, args: argparse.Namespace) -> list[tuple]:
    b, heads, s = (2, 4, 128) if args.quick else (4, 8, 512)
    scale = 0.125
    mask = torch.rand(b, 1, s, s) < 0.1
    causal = torch.ones(1, 1, s, s, dtype=torch.bool).triu(1)
    x = torch.randn(b, heads, s, s).to(dtype)
    xg = x.clone().requires_grad_()
    shape = f"[{b},{heads},{s},{s}]"

    def torch_masked(t: torch.Tensor, m: torch.Tensor = mask) -> torch.Tensor:
        # Megatron's unfused path: scale, mask, softmax as three ops.
        return torch.softmax((t * scale).masked_fill(m, float("-inf")), dim=-1)

    def torch_causal(t: torch.Tensor) -> torch.Tensor:
        return torch_masked(t, causal)

    def fused_masked(t: torch.Tensor) -> torch.Tensor:
        return scaled_masked_softmax(t, mask, scale)

    def fused_causal(t: torch.Tensor) -> torch.Tensor:
        return scaled_upper_triang_masked_softmax(t, scale)

    r = args.repeats
    return [
        row("scaled_masked_softmax", shape, dtype, "fwd", lambda: torch_masked(x), lambda: fused_masked(x), r),
        row("scaled_masked_softmax", shape, dtype, "fwd+bwd", fwd_bwd(torch_masked, xg), fwd_bwd(fused_masked, xg), r),
        row(
            "scaled_upper_triang_masked_softmax",
            shape,
            dtype,
            "fwd",
            lambda: torch_causal(x),
            lambda: fused_causal(x),
            r,
        ),
        row(
            "scaled_upper_triang_masked_softmax",
            shape,
            dtype,
            "fwd+bwd",
            fwd_bwd(torch_causal, xg),
            fwd_bwd(fused_causal, xg),
            r,
        ),
    ]


def layer_norm_rows(dtype: torch.dtype, args: argparse.Namespace) -> list[tuple]:
    n, h = (512, 256) if args.quick else (4096, 1024)
    x, res = torch.randn(n, h).to(dtype), torch.randn(n, h).to(dtype)
    w, b, xb = torch.randn(h).to(dtype), torch.randn(h).to(dtype), torch.randn(h).to(dtype)
    grads = [t.clone().requires_grad_() for t in (x, res, w, b, xb)]
    gx, _, gw, gb, _ = grads
    shape = f"[{n},{h}]"

    def torch_ln(t, w_, b_):
        return F.layer_norm(t, (h,), w_, b_)

    def torch_add_ln(t, r, w_, b_, xb_):
        s = t + xb_ + r
        return F.layer_norm(s, (h,), w_, b_), s

    def fused_add_ln(t, r, w_, b_, xb_):
        return fused_add_layer_norm(t, r, w_, b_, x_bias=xb_)

    r = args.repeats
    name = "bias+residual+layer_norm"
    return [
        row("layer_norm", shape, dtype, "fwd", lambda: torch_ln(x, w, b), lambda: layer_norm(x, w, b), r),
        row("layer_norm", shape, dtype, "fwd+bwd", fwd_bwd(torch_ln, gx, gw, gb), fwd_bwd(layer_norm, gx, gw, gb), r),
        row(
            name, shape, dtype, "fwd", lambda: torch_add_ln(x, res, w, b, xb), lambda: fused_add_ln(x, res, w, b, xb), r
        ),
        row(name, shape, dtype, "fwd+bwd", fwd_bwd(torch_add_ln, *grads), fwd_bwd(fused_add_ln, *grads), r),
    ]


def bias_gelu_rows(dtype: torch.dtype, args: argparse.Namespace) -> list[tuple]:
    n, h = (512, 1024) if args.quick else (4096, 4096)
    x, b = torch.randn(n, h).to(dtype), torch.randn(h).to(dtype)
    gx, gb = x.clone().requires_grad_(), b.clone().requires_grad_()
    shape = f"[{n},{h}]"

    def torch_bias_gelu(t, b_):
        return F.gelu(t + b_, approximate="tanh")

    r = args.repeats
    return [
        row("bias_gelu", shape, dtype, "fwd", lambda: torch_bias_gelu(x, b), lambda: bias_gelu(x, b), r),
        row("bias_gelu", shape, dtype, "fwd+bwd", fwd_bwd(torch_bias_gelu, gx, gb), fwd_bwd(bias_gelu, gx, gb), r),
    ]


def cross_entropy_rows(dtype: torch.dtype, args: argparse.Namespace) -> list[tuple]:
    n, v = (256, 8192) if args.quick else (2048, 50304)
    logits = torch.randn(n, v).to(dtype)
    targets = torch.randint(0, v, (n,))
    gl = logits.clone().requires_grad_()
    shape = f"[{n},{v}]"

    def torch_ce(t):
        # Losses are computed in fp32 either way (as Megatron casts logits to float).
        return F.cross_entropy(t.float(), targets, reduction="none")

    def fused_ce(t):
        return fused_vocab_cross_entropy(t, targets)

    r = args.repeats
    return [
        row("fused_vocab_cross_entropy", shape, dtype, "fwd", lambda: torch_ce(logits), lambda: fused_ce(logits), r),
        row("fused_vocab_cross_entropy", shape, dtype, "fwd+bwd", fwd_bwd(torch_ce, gl), fwd_bwd(fused_ce, gl), r),
    ]


def rms_norm_rows(dtype: torch.dtype, args: argparse.Namespace) -> list[tuple]:
    n, h = (512, 256) if args.quick else (4096, 1024)
    x, w = torch.randn(n, h).to(dtype), (1 + 0.1 * torch.randn(h)).to(dtype)
    gx, gw = x.clone().requires_grad_(), w.clone().requires_grad_()
    shape = f"[{n},{h}]"

    def torch_rms(t, w_):
        return rms_norm(t, w_, 1e-5)  # the model's reference: fp32 statistics, cast, weight multiply

    def fused_rms(t, w_):
        return fused_rms_norm(t, w_, 1e-5)

    r = args.repeats
    return [
        row("rms_norm", shape, dtype, "fwd", lambda: torch_rms(x, w), lambda: fused_rms(x, w), r),
        row("rms_norm", shape, dtype, "fwd+bwd", fwd_bwd(torch_rms, gx, gw), fwd_bwd(fused_rms, gx, gw), r),
    ]


def swiglu_rows(dtype: torch.dtype, args: argparse.Namespace) -> list[tuple]:
    n, f = (512, 512) if args.quick else (4096, 2816)
    gate_up = (torch.randn(n, 2 * f) * 2).to(dtype)
    g = gate_up.clone().requires_grad_()
    shape = f"[{n},2x{f}]"
    r = args.repeats
    return [
        row("swiglu", shape, dtype, "fwd", lambda: swiglu(gate_up), lambda: fused_swiglu(gate_up), r),
        row("swiglu", shape, dtype, "fwd+bwd", fwd_bwd(swiglu, g), fwd_bwd(fused_swiglu, g), r),
    ]


def rotary_rows(dtype: torch.dtype, args: argparse.Namespace) -> list[tuple]:
    # Query heads as the model sees them: a permuted [b, heads, s, hd] view of the [s, b, ...] QKV output.
    b, heads, s, hd = (2, 4, 128, 64) if args.quick else (4, 16, 512, 64)
    qkv = torch.randn(s, b, 2 * heads, hd).to(dtype)
    g = qkv.clone().requires_grad_()
    cos, sin = rotary_cos_sin(torch.arange(s), hd, 500000.0)
    shape = f"[{b},{heads},{s},{hd}] view"

    def torch_rotary(t):
        return apply_rotary(t[:, :, :heads].permute(1, 2, 0, 3), cos, sin)

    def fused_rotary(t):
        return fused_apply_rotary(t[:, :, :heads].permute(1, 2, 0, 3), cos, sin)

    r = args.repeats
    return [
        row("apply_rotary", shape, dtype, "fwd", lambda: torch_rotary(qkv), lambda: fused_rotary(qkv), r),
        row("apply_rotary", shape, dtype, "fwd+bwd", fwd_bwd(torch_rotary, g), fwd_bwd(fused_rotary, g), r),
    ]


SECTIONS = {
    "softmax": softmax_rows,
    "layer_norm": layer_norm_rows,
    "bias_gelu": bias_gelu_rows,
    "cross_entropy": cross_entropy_rows,
    "rms_norm": rms_norm_rows,
    "swiglu": swiglu_rows,
    "rotary": rotary_rows,
}


def adam_rows(args: argparse.Namespace) -> list[tuple]:
    numel = int(args.adam_params)
    repeats = max(2, args.repeats // 3)
    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(numel, generator=gen)

    def torch_opt(**kwargs) -> tuple[torch.optim.Optimizer, torch.Tensor]:
        param = torch.randn(numel, generator=gen).requires_grad_()
        param.grad = grad
        return torch.optim.AdamW([param], lr=1e-3, weight_decay=0.01, **kwargs), param

    foreach_opt, _ = torch_opt(foreach=True)
    fused_opt, fused_param = torch_opt(fused=True)
    master, m, v = torch.randn(numel, generator=gen), torch.zeros(numel), torch.zeros(numel)
    copy = torch.empty(numel, dtype=torch.bfloat16)
    step = [0]

    def ours(with_copy: bool) -> None:
        step[0] += 1
        adam_step_(master, grad, m, v, step=step[0], lr=1e-3, weight_decay=0.01, param_copy=copy if with_copy else None)

    def fused_then_copy() -> None:
        fused_opt.step()
        copy.copy_(fused_param.detach())

    shape = f"{numel / 1e6:.0f}M params"
    return [
        (
            "CPUAdam vs AdamW(foreach)",
            shape,
            torch.float32,
            "step",
            *compare(foreach_opt.step, lambda: ours(False), repeats),
        ),
        (
            "CPUAdam vs AdamW(fused)",
            shape,
            torch.float32,
            "step",
            *compare(fused_opt.step, lambda: ours(False), repeats),
        ),
        (
            "CPUAdam+bf16 copy vs AdamW(fused)+copy_",
            shape,
            torch.float32,
            "step",
            *compare(fused_then_copy, lambda: ours(True), repeats),
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small shapes (smoke run)")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per measurement (best is kept)")
    parser.add_argument("--adam-params", type=float, default=100e6, help="fp32 parameters in the Adam rows")
    parser.add_argument("--skip-adam", action="store_true", help="leave out the Adam rows")
    parser.add_argument("--ops", nargs="+", choices=list(SECTIONS), default=list(SECTIONS), help="sections to run")
    args = parser.parse_args()
    if args.quick:
        args.adam_params = min(args.adam_params, 1e6)
    if not csrc_available():
        sys.exit("compiled kernels are not available: run `pip install -e . --no-build-isolation` first")

    print(
        f"# {time.strftime('%Y-%m-%d %H:%M')} | {platform.processor() or platform.machine()} | "
        f"torch {torch.__version__} | threads {torch.get_num_threads()} | csrc ISA {csrc_isa()}"
    )
    print("| op | shape | dtype | pass | PyTorch (ms) | fused (ms) | speedup |")
    print("|---|---|---|---|---:|---:|---:|")
    rows = (
        row_
        for section in (SECTIONS[name] for name in args.ops)
        for dtype in (torch.float32, torch.bfloat16)
        for row_ in section(dtype, args)
    )
    if not args.skip_adam:
        rows = itertools.chain(rows, adam_rows(args))
    for name, shape, dtype, kind, torch_ms, fused_ms in rows:
        dtype_name = str(dtype).removeprefix("torch.")
        print(
            f"| {name} | {shape} | {dtype_name} | {kind} | {torch_ms:.2f} | {fused_ms:.2f} | "
            f"{torch_ms / fused_ms:.2f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()
