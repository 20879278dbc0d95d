"""Long-context attention: the blockwise core (``model/blockwise_attention.py``) against PyTorch's SDPA given the
dense ``[s, s]`` mask of the same pairs, forward + backward, on one process.

    .venv/bin/python benchmarks/long_context.py                    # s = 8192, 4 heads of 64, one thread
    .venv/bin/python benchmarks/long_context.py --seq-length 2048 --repeats 3 --block-size 128

Rows (float32, batch 1, causal):

- ``packed documents``: documents of average length s / 8 (lengths drawn uniformly from s / 16 .. 3 s / 16, the
  last one cut to fill the sequence), attention within each document (``--reset-attention-mask``);
- ``sliding window``: each query sees itself and the s / 8 - 1 keys before it (``--window-size s/8-1,0``).

Each side runs forward + backward of the same q, k, v and output gradient; the sides alternate repeat by repeat
(after one warm-up call each) so a slow period of the machine hits both, and the table gives the medians, the
speedup, the share of query-key tiles the blockwise core computed, and the largest difference of output and
gradients between the two sides ("same result"). Timings on a shared machine are noisy: compare ratios from one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_like.model.blockwise_attention import allowed_pairs, block_plan, blockwise_attention  # noqa: E402


def document_ids(seq_length: int, generator: torch.Generator) -> torch.Tensor:
    """long ``[1, s]``: documents of average length s / 8."""
    lengths, total = [], 0
    while total < seq_length:
        length = int(torch.randint(seq_length // 16, 3 * seq_length // 16 + 1, (1,), generator=generator))
        lengths.append(min(length, seq_length - total))
        total += lengths[-1]
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]


def forward_backward(attention, q, k, v, grad_out) -> tuple[float, list[torch.Tensor]]:
    """Seconds of one forward + backward, and (out, dq, dk, dv)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    start = time.perf_counter()
    out = attention(q, k, v)
    out.backward(grad_out)
    return time.perf_counter() - start, [out.detach(), q.grad, k.grad, v.grad]


def measure(name: str, masking: dict, seq_length: int, heads: int, head_dim: int, block_size: int,
            repeats: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    q, k, v, grad_out = (torch.randn(1, heads, seq_length, head_dim, generator=generator) for _ in range(4))
    positions = torch.arange(seq_length)
    documents = masking.get("q_documents")
    window_left = masking.get("window_left")
    dense_mask = allowed_pairs(positions, positions, documents, documents, window_left, True)[:, None]

    def blockwise(q, k, v):
        return blockwise_attention(q, k, v, block_size=block_size, k_documents=documents, **masking)[0]

    def dense(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask)

    times = {"blockwise": [], "sdpa dense mask": []}
    results = {}
    for attention in (blockwise, dense):  # warm-up: first-call allocations and kernel selection
        forward_backward(attention, q, k, v, grad_out)
    for _ in range(repeats):
        for side, attention in (("blockwise", blockwise), ("sdpa dense mask", dense)):
            seconds, results[side] = forward_backward(attention, q, k, v, grad_out)
            times[side].append(seconds)
    plan = block_plan(positions, positions, documents, documents, window_left, True, block_size, block_size)
    tiles = sum(len(k_slices) for _, k_slices in plan)
    blocks = len(plan)
    difference = max(float((a - b).abs().max()) for a, b in zip(results["blockwise"], results["sdpa dense mask"]))
    median = {side: statistics.median(values) for side, values in times.items()}
    return {"case": name, "blockwise": median["blockwise"], "dense": median["sdpa dense mask"],
            "speedup": median["sdpa dense mask"] / median["blockwise"], "tiles": tiles / (blocks * blocks),
            "difference": difference}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-length", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=256, help="the blockwise core's query and key blocks")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    s = args.seq_length
    cases = {
        "packed documents (avg s/8)": {"q_documents": document_ids(s, torch.Generator().manual_seed(1))},
        "sliding window (s/8 keys)": {"window_left": s // 8 - 1},
    }
    print(f"s = {s}, {args.heads} heads of {args.head_dim}, float32, batch 1, block {args.block_size}, "
          f"{args.threads} thread(s), forward + backward, median of {args.repeats}")
    print("| case | blockwise s | SDPA + dense mask s | speedup | tiles computed | max abs difference |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, masking in cases.items():
        row = measure(name, masking, s, args.heads, args.head_dim, args.block_size, args.repeats)
        print(f"| {row['case']} | {row['blockwise']:.3f} | {row['dense']:.3f} | {row['speedup']:.1f}x | "
              f"{row['tiles']:.1%} | {row['difference']:.1e} |", flush=True)


if __name__ == "__main__":
    main()
