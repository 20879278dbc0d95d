"""Plan a run without a cluster: per-rank memory and a throughput estimate from the training flags.

    python tools/plan.py --world-size 1024 --num-layers 96 --hidden-size 12288 ... (pretrain_gpt.py flags)
    DRY_RUN=1 bash scripts/pretrain_gpt_175B.sh        # the launch scripts call this

Takes every ``pretrain_gpt.py`` flag (data files are never opened) plus the options below, builds the
model of each pipeline role on the meta device under a fake process group of ``--world-size`` ranks
(``megatron_like.planning.simulator``) and prints one row per pipeline rank and the line
``max memory per device: X GiB``. Exits 1 when a rank would exceed ``--device-memory-gib``. With
``--num-experts`` it also prints the active parameters per token and the bytes each rank sends through the token
dispatcher per iteration (docs/launch.md, docs/moe.md).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_like.config import ConfigError, build_parser, config_from_namespace  # noqa: E402
from megatron_like.planning.simulator import GIB, format_plan, plan_run  # noqa: E402

KNOWN_VOCAB_SIZES = {"GPT2BPETokenizer": 50257}


def vocab_size_of(config) -> int:
    """The unpadded vocabulary: --vocab-size, a known tokenizer's size, or the tokenizer files' size."""
    if config.model.vocab_size is not None:
        return config.model.vocab_size
    tokenizer_type = config.data.tokenizer_type
    if tokenizer_type in KNOWN_VOCAB_SIZES:
        return KNOWN_VOCAB_SIZES[tokenizer_type]
    from megatron_like.data.tokenizer import build_tokenizer

    d = config.data
    return build_tokenizer(d.tokenizer_type, d.vocab_file, d.merge_file, d.tokenizer_model, None).vocab_size


def main(argv: list[str] | None = None) -> int:
    parser = build_parser("Plan a run: per-rank memory and throughput estimate (no training)")
    plan_group = parser.add_argument_group("plan", "What the simulated cluster looks like")
    plan_group.add_argument("--world-size", type=int, required=True, help="number of devices (processes)")
    plan_group.add_argument("--device-memory-gib", type=float, default=80.0,
                            help="memory of one device; exit 1 when a rank needs more (default: 80)")
    plan_group.add_argument("--device-tflops", type=float, default=312.0,
                            help="peak TFLOP/s of one device in the run's dtype (default: 312, A100 bf16)")
    plan_group.add_argument("--compute-efficiency", type=float, default=0.45,
                            help="fraction of the peak the matmuls reach outside the bubble (default: 0.45)")
    plan_group.add_argument("--plan-device", choices=["cuda", "cpu"], default="cuda",
                            help="device type whose attention kernels are assumed (default: cuda)")
    args = parser.parse_args(argv)
    try:
        config = config_from_namespace(args, args.world_size).validate()
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    padded = config.padded_vocab_size(vocab_size_of(config))
    plan = plan_run(config, padded, args.device_tflops, args.compute_efficiency, args.plan_device)
    print(format_plan(plan, args.device_memory_gib), flush=True)
    if plan.max_device_bytes / GIB > args.device_memory_gib:
        worst = max(plan.ranks, key=lambda r: r.device_bytes)
        print(f"error: pipeline rank {worst.pp_rank} needs {worst.device_bytes / GIB:.2f} GiB, more than "
              f"--device-memory-gib {args.device_memory_gib:g}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
