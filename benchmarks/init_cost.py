"""What layout-independent initialization costs one rank: time and peak memory to build transformer layers.

Every rank draws each weight whole from its own generator (on the CPU) and keeps its tensor-parallel slice
(``megatron_like/tensor_parallel/initialization.py``), so a rank spends the time of drawing its layers
*unsplit*, whatever tp is. This builds ``--layers`` real layers as tp rank ``--tp-rank`` of ``--tp`` (PyTorch's
fake process group: no other process needed) and, optionally, the word embedding, in two ways, alternating:

* ``chunked``: the code as it is: each weight drawn in chunks of rows (``DRAW_CHUNK_ELEMENTS``);
* ``whole``:   each weight drawn at once, the previous code's peak (the full fp32 weight, then the slice).

Both give the same bits (checked here too). Per build it prints the wall time and the peak bytes of live
tensors (the profiler's allocation log), which includes the layer's own bf16 slices::

    .venv/bin/python benchmarks/init_cost.py                      # GPT-3 175B: hidden 12288, tp 8, 2 layers
    .venv/bin/python benchmarks/init_cost.py --hidden-size 1024 --tp 1 --layers 4

Timings on a shared machine are noisy; compare the two modes from one run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

# Run as `python benchmarks/...` from anywhere: the repository root holds pretrain_gpt.py, megatron_like/ and tests/.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_like.config import ModelConfig, ParallelConfig
from megatron_like.model.transformer import TransformerLayer
from megatron_like.parallel_state import ParallelState
from megatron_like.planning.simulator import fake_world
from megatron_like.tensor_parallel import VocabParallelEmbedding, initialization, normal_init
from tests.peak_memory import peak_live_bytes

GIB = 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden-size", type=int, default=12288)
    parser.add_argument("--num-attention-heads", type=int, default=96)
    parser.add_argument("--num-layers", type=int, default=96, help="the model's layers (scales the init std only)")
    parser.add_argument("--layers", type=int, default=2, help="layers to build and time")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--tp-rank", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=0, help="also build the word embedding (padded vocab)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one core per rank, as a launched job has

    config = ModelConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                         num_attention_heads=args.num_attention_heads, seq_length=2048)
    chunk_default = initialization.DRAW_CHUNK_ELEMENTS
    with fake_world(args.tp, args.tp_rank):
        ps = ParallelState.initialize(ParallelConfig(tensor_model_parallel_size=args.tp, distributed_backend=None),
                                      args.tp)
        builds = [(f"layer {i}", lambda i=i: TransformerLayer(config, ps, i, 1234, True, torch.bfloat16))
                  for i in range(args.layers)]
        if args.vocab_size:
            builds.append(("word embedding", lambda: VocabParallelEmbedding(
                args.vocab_size, args.hidden_size, tp_group=ps.tp_group, init_method=normal_init(0.006), seed=1234,
                name="embedding.word_embeddings", dtype=torch.bfloat16)))
        for name, build in builds:
            results = {}
            for mode in ("chunked", "whole", "chunked", "whole"):  # alternate: a slow spell hits both
                initialization.DRAW_CHUNK_ELEMENTS = chunk_default if mode == "chunked" else 2**62
                start = time.perf_counter()
                peak, module = peak_live_bytes(build)
                seconds = time.perf_counter() - start
                state = {k: v.clone() for k, v in module.state_dict().items()}
                del module
                best = results.get(mode)
                if best is None or seconds < best[0]:
                    results[mode] = (seconds, peak, state)
            initialization.DRAW_CHUNK_ELEMENTS = chunk_default
            same = all(torch.equal(results["chunked"][2][k], results["whole"][2][k]) for k in results["whole"][2])
            slices = sum(v.numel() * v.element_size() for v in results["chunked"][2].values())
            print(f"{name}: tp rank {args.tp_rank} of {args.tp} holds {slices / GIB:.3f} GiB | "
                  + " | ".join(f"{mode}: {s:.1f} s, peak {p / GIB:.3f} GiB" for mode, (s, p, _) in results.items())
                  + f" | same bits: {same}", flush=True)


if __name__ == "__main__":
    main()
