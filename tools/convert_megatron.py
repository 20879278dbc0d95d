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
comes from the checkpoint's ``args``. Carried: weights, iteration and arguments; not (yet): optimizer state, lr
schedule, RNG (continue with ``--finetune`` or ``--no-load-optim``); docs/checkpoints.md, "Megatron-LM checkpoints".
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_like.config import Config, ConfigError, QuietArgumentParser  # noqa: E402
from megatron_like.model import megatron_names as names  # noqa: E402
from megatron_like.model.state import (  # noqa: E402
    VOCAB_PARAMS,
    CheckpointLoadError,
    checkpoint_iteration_dir,
    load_full_state,
    resize_vocab,
)
from megatron_like.training import megatron_format as mf  # noqa: E402
from megatron_like.training.checkpointing import CheckpointError  # noqa: E402


def to_megatron(args: argparse.Namespace) -> None:
    config, full = load_full_state(args.load, args.iteration)
    p, m = config.parallel, config.model
    tp = args.target_tensor_parallel_size or p.tensor_model_parallel_size
    pp = args.target_pipeline_model_parallel_size or p.pipeline_model_parallel_size
    ep = args.target_expert_model_parallel_size or p.expert_model_parallel_size
    if m.num_layers % pp:
        raise ValueError(f"--target-pipeline-model-parallel-size {pp} does not divide the {m.num_layers} layers")
    rows = full[VOCAB_PARAMS[0]].shape[0]
    target = copy.deepcopy(config)  # Megatron-LM pads the vocabulary for the target tp
    target.parallel.tensor_model_parallel_size = tp
    padded = target.padded_vocab_size(m.vocab_size or rows)
    full = {k: resize_vocab(v, padded) if k in VOCAB_PARAMS else v for k, v in full.items()}
    iteration = int(os.path.basename(checkpoint_iteration_dir(args.load, args.iteration))[len("iter_"):])
    per_layer = names.to_megatron_layers(full, m, args.layer_spec, sharded=args.ckpt_format == "torch_dist")
    if args.ckpt_format == "torch":
        mf.save_legacy(args.save, iteration, config, per_layer, padded, tp=tp, pp=pp, ep=ep, spec=args.layer_spec,
                       experts=args.moe_experts)
    else:
        mglobal = names.stack_layers(per_layer, m.num_layers) if names.is_stacked(m) else per_layer
        mf.save_torch_dist(args.save, iteration, config, mglobal, padded, tp=tp, pp=pp, ep=ep, spec=args.layer_spec)
    print(f"wrote a Megatron-LM {args.ckpt_format} checkpoint (iteration {iteration}, tp {tp}, pp {pp}, ep {ep}, "
          f"{args.layer_spec} layer spec) to {args.save}")


def from_megatron(args: argparse.Namespace) -> None:
    it_dir = checkpoint_iteration_dir(args.load, args.iteration)
    margs = mf.read_args(it_dir)
    config = Config()
    try:
        config.model = mf.model_config_from_args(margs)
    except (TypeError, ValueError) as error:
        raise ValueError(f"the Megatron-LM arguments of {it_dir} describe no model of this codebase: {error}") from None
    m = config.model
    if mf.is_megatron_torch_dist(it_dir):
        full = names.from_megatron_global(mf.load_torch_dist(it_dir), m)
    else:
        full = names.from_megatron_layers(mf.load_legacy(it_dir, margs, m), m)
    rows = full[VOCAB_PARAMS[0]].shape[0]
    m.vocab_size = getattr(margs, "vocab_size", None) or rows
    p = config.parallel
    p.tensor_model_parallel_size = args.target_tensor_parallel_size or margs.tensor_model_parallel_size
    p.pipeline_model_parallel_size = args.target_pipeline_model_parallel_size or margs.pipeline_model_parallel_size
    p.expert_model_parallel_size = (args.target_expert_model_parallel_size
                                    or getattr(margs, "expert_model_parallel_size", 1) or 1)
    config.world_size = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.expert_model_parallel_size
    config.data.mock_data = True  # validates without --data-path; the tokenizer is not in Megatron's checkpoint
    config.validate()
    padded = config.padded_vocab_size(m.vocab_size)
    full = {k: resize_vocab(v, padded) if k in VOCAB_PARAMS else v for k, v in full.items()}
    iteration = int(os.path.basename(it_dir)[len("iter_"):])
    from megatron_like.training.dist_checkpointing import save_full_state

    save_full_state(args.save, iteration, config, {"model." + k: v for k, v in full.items()},
                    extra={"consumed_samples": int(getattr(margs, "consumed_train_samples", 0) or 0)})
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
