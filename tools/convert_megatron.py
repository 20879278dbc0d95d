"""Convert between our checkpoints and Megatron-LM's (its legacy torch format and Megatron-core's torch_dist).

    python tools/convert_megatron.py --direction to-megatron --load ckpt/ours --save ckpt/mlm \\
        --ckpt-format torch --target-tensor-parallel-size 2 --target-pipeline-model-parallel-size 2
    python tools/convert_megatron.py --direction from-megatron --load ckpt/mlm --save ckpt/ours

``to-megatron`` reads our checkpoint of either format at any layout and writes Megatron-LM's: ``--ckpt-format
torch`` (``iter_N/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`` at the target layout, experts as GroupedMLP or
SequentialMLP with ``--moe-experts``) or ``torch_dist`` (Megatron-core's sharded keys, stacked ``[L, ...]`` for
uniform models, its ``_extra_state`` objects, ``metadata.json``, ``common.pt``; loads at any layout), names of the
local layer spec or Transformer Engine's (``--layer-spec``). ``from-megatron`` reads either format (found from the
directory) and writes our torch_dist at the same iteration, which loads at any layout; the model's configuration
comes from the checkpoint's ``args``. Carried: weights, iteration, arguments, consumed samples, lr schedule, the
optimizer state (torch_dist: the distributed optimizer's model-space layout; legacy files: the non-distributed
optimizer's entry) and, to Megatron-LM at the source's tp x pp, the RNG states; docs/checkpoints.md,
"Megatron-LM checkpoints".
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_like.config import ConfigError, QuietArgumentParser  # noqa: E402
from megatron_like.model import megatron_names as names  # noqa: E402
from megatron_like.model.state import (  # noqa: E402
    VOCAB_PARAMS,
    CheckpointLoadError,
    checkpoint_iteration_dir,
    resize_vocab,
)
from megatron_like.training import megatron_format as mf  # noqa: E402
from megatron_like.training.checkpointing import CheckpointError  # noqa: E402
from megatron_like.training.megatron_export import export_to_megatron  # noqa: E402
from megatron_like.training.megatron_load import (  # noqa: E402
    megatron_kind,
    open_megatron,
    read_global_state,
    saved_schedule,
    saved_step,
)


def to_megatron(args: argparse.Namespace) -> None:
    print(export_to_megatron(args.load, args.save, args.iteration, ckpt_format=args.ckpt_format, spec=args.layer_spec,
                             experts=args.moe_experts, tp=args.target_tensor_parallel_size,
                             pp=args.target_pipeline_model_parallel_size, ep=args.target_expert_model_parallel_size))


def from_megatron(args: argparse.Namespace) -> None:
    it_dir = checkpoint_iteration_dir(args.load, args.iteration)
    kind = megatron_kind(it_dir)
    if kind is None:
        raise CheckpointError(f"{it_dir} holds neither metadata.json (torch_dist) nor mp_rank_* files with Megatron-LM "
                              "args (legacy torch): not a Megatron-LM checkpoint")
    megatron = open_megatron(it_dir, kind)
    config, margs = megatron.config, megatron.args
    full = read_global_state(megatron, with_optimizer=True)
    rows = full["model." + VOCAB_PARAMS[0]].shape[0]
    config.model.vocab_size = config.model.vocab_size or rows
    p = config.parallel
    p.tensor_model_parallel_size = args.target_tensor_parallel_size or margs.tensor_model_parallel_size
    p.pipeline_model_parallel_size = args.target_pipeline_model_parallel_size or margs.pipeline_model_parallel_size
    p.expert_model_parallel_size = (args.target_expert_model_parallel_size
                                    or getattr(margs, "expert_model_parallel_size", 1) or 1)
    config.world_size = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.expert_model_parallel_size
    if config.global_batch_size % (config.training.micro_batch_size * config.data_parallel_size):
        # Megatron-LM's batch at its data-parallel size does not split at this smallest layout: the stored config
        # names none (a resuming run's flags set it; its notice names a change)
        config.training.global_batch_size = None
    config.data.mock_data = True  # validates without --data-path; the tokenizer is not in Megatron's checkpoint
    config.validate()
    padded = config.padded_vocab_size(config.model.vocab_size)
    full = {k: resize_vocab(v, padded) if k.endswith(VOCAB_PARAMS) else v for k, v in full.items()}
    iteration = int(os.path.basename(it_dir)[len("iter_"):])
    schedule, step = saved_schedule(megatron), saved_step(megatron)
    from megatron_like.training.dist_checkpointing import save_full_state

    save_full_state(args.save, iteration, config, full, extra={
        "consumed_samples": int(getattr(margs, "consumed_train_samples", 0) or 0), "scheduler": schedule,
        "optimizer": {"step": step, "loss_scaler": None} if any(k.startswith("optimizer.") for k in full) else None})
    print(f"wrote our torch_dist checkpoint (iteration {iteration}, loads at any layout) to {args.save}")


def build_parser() -> argparse.ArgumentParser:
    parser = QuietArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--direction", required=True, choices=("to-megatron", "from-megatron"))
    parser.add_argument("--load", required=True, help="Source checkpoint directory (holding the tracker file).")
    parser.add_argument("--save", required=True, help="Output checkpoint directory.")
    parser.add_argument("--iteration", type=int, help="Iteration to convert (default: the latest).")
    parser.add_argument("--ckpt-format", choices=("torch_dist", "torch"), default="torch_dist",
                        help="to-megatron: Megatron-core's torch_dist (default) or Megatron-LM's legacy torch files.")
    parser.add_argument("--layer-spec", choices=names.SPECS, default="local",
                        help="to-megatron: norm names of Megatron-core's local spec or Transformer Engine's (fused).")
    parser.add_argument("--moe-experts", choices=mf.EXPERT_STYLES, default="grouped",
                        help="to-megatron --ckpt-format torch: GroupedMLP (--moe-grouped-gemm) or SequentialMLP keys.")
    parser.add_argument("--target-tensor-parallel-size", type=int, help="Default: the source's.")
    parser.add_argument("--target-pipeline-model-parallel-size", type=int, help="Default: the source's.")
    parser.add_argument("--target-expert-model-parallel-size", type=int, help="Default: the source's.")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        (to_megatron if args.direction == "to-megatron" else from_megatron)(args)
    except (OSError, ValueError, KeyError, CheckpointError, CheckpointLoadError, ConfigError) as error:
        print(f"error: {str(error).strip(chr(39))}", file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
