"""Convert a checkpoint to another tensor / pipeline (/ virtual pipeline) parallel layout.

    python tools/checkpoint_reshard.py --load ckpt/tp2pp2 --save ckpt/tp1pp1 \
        --target-tensor-model-parallel-size 1 --target-pipeline-model-parallel-size 1

Every ``mp_rank_TT_PPP`` shard of the source is merged into full weights and cut into the target's
shards with ``megatron_like.model.state`` (the same code the inference loader uses), so a forked model
with new parameters reshards without edits here. The vocabulary rows are re-padded to the target's
``--make-vocab-size-divisible-by * tp``. The result is a normal checkpoint (docs/design.md §5) that
``pretrain_gpt.py --load`` resumes with the target layout flags at the same iteration, consumed samples
and learning-rate schedule.

The optimizer state (AdamW moments, fp32 masters, loss scaler) of every ZeRO shard is merged per
parameter and re-cut for ``--target-data-parallel-size`` and ``--target-zero-stage`` (default: the
source's) by ``megatron_like.training.optimizer_reshard``; ``--no-optimizer`` drops it (Adam restarts,
as with ``--no-load-optim``). Not carried over: the RNG states (per rank: the resumed run keeps its
freshly seeded generators).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron_like.config import Config, ConfigError  # noqa: E402
from megatron_like.model.state import (  # noqa: E402
    CHECKPOINT_FILE,
    VOCAB_PARAMS,
    checkpoint_iteration_dir,
    is_torch_dist,
    load_full_state,
    resize_vocab,
    shard_full_state,
)
from megatron_like.training.checkpointing import TRACKER_FILE, write_atomically  # noqa: E402
from megatron_like.training.optimizer_reshard import gather_full_optimizer, shard_full_optimizer  # noqa: E402


def target_config(saved: Config, tp: int, pp: int, vp_layers: int | None, dp: int, zero_stage: int) -> Config:
    """The saved config with the target layout (validated: heads, layers and sizes must split)."""
    config = copy.deepcopy(saved)
    p = config.parallel
    p.tensor_model_parallel_size, p.pipeline_model_parallel_size = tp, pp
    p.num_layers_per_virtual_pipeline_stage = vp_layers
    if tp == 1:
        p.sequence_parallel = False
    p.zero_stage, p.use_distributed_optimizer = zero_stage, False
    config.world_size = tp * pp * dp
    # Only the model split is checked here; batch sizes are checked against dp when the run resumes.
    config.training.global_batch_size = config.training.micro_batch_size * dp * pp
    config.validate()
    config.training.global_batch_size = saved.training.global_batch_size
    return config


def read_optimizer_shards(load_dir: str, saved: Config, saved_dp: int) -> dict[tuple[int, int, int], dict] | None:
    """Every rank's optimizer state dict of the source, keyed by (tp, pp, dp); None if it holds none."""
    p = saved.parallel
    shards = {}
    for tp_rank in range(p.tensor_model_parallel_size):
        for pp_rank in range(p.pipeline_model_parallel_size):
            directory = os.path.join(load_dir, f"mp_rank_{tp_rank:02d}_{pp_rank:03d}")
            for dp_rank in range(saved_dp if p.zero_stage >= 1 else 1):
                name = CHECKPOINT_FILE if dp_rank == 0 else f"optim_rng_dp_{dp_rank:03d}.pt"
                state = torch.load(os.path.join(directory, name), map_location="cpu", weights_only=True)
                if state.get("optimizer") is None:
                    return None
                shards[(tp_rank, pp_rank, dp_rank)] = state["optimizer"]
    return shards


def real_vocab_size(saved: Config, saved_rows: int, override: int | None) -> int:
    """The unpadded vocabulary: --vocab-size here, the saved --vocab-size, else the saved padded rows."""
    if override is not None:
        return override
    if saved.model.vocab_size is not None:
        return saved.model.vocab_size
    try:
        from megatron_like.inference.loading import build_tokenizer_for

        tokenizer = build_tokenizer_for(saved.data, None)
        if tokenizer is not None:
            return tokenizer.vocab_size
    except (OSError, ValueError, KeyError, ImportError) as error:
        print(f" > cannot build the saved tokenizer ({error}); keeping all {saved_rows} saved vocabulary rows")
    return saved_rows


def reshard(load: str, save: str, tp: int, pp: int, vp_layers: int | None = None, iteration: int | None = None,
            vocab_size: int | None = None, dp: int | None = None, zero_stage: int | None = None,
            with_optimizer: bool = True) -> str:
    """Write the checkpoint ``load`` (latest, or ``iteration``) under ``save`` in the target layout.

    ``dp`` and ``zero_stage`` (default: the source's) lay out the optimizer state, which is carried over
    unless ``with_optimizer`` is False or the source has none.
    """
    source_dir = checkpoint_iteration_dir(load, iteration)
    saved, full = load_full_state(load, iteration)
    first_path = os.path.join(source_dir, "mp_rank_00_000", CHECKPOINT_FILE)
    first = torch.load(first_path, weights_only=True, map_location="cpu", mmap=True)
    saved_dp = first.get("dp_size", 1)
    dp = saved_dp if dp is None else dp
    zero_stage = saved.parallel.zero_stage if zero_stage is None else zero_stage
    config = target_config(saved, tp, pp, vp_layers, dp, zero_stage)
    saved_rows = full[VOCAB_PARAMS[0]].shape[0]
    padded = config.padded_vocab_size(real_vocab_size(saved, saved_rows, vocab_size))
    if padded < saved_rows:
        print(f" > vocabulary rows {saved_rows} -> {padded} (padding rows dropped)")
    optimizer_full = None
    if with_optimizer:
        shards = read_optimizer_shards(source_dir, saved, saved_dp)
        if shards is None:
            print(" > the source holds no optimizer state; the result holds none either")
        else:
            source = copy.deepcopy(saved)
            source.world_size = saved_dp * (saved.parallel.tensor_model_parallel_size
                                             * saved.parallel.pipeline_model_parallel_size)
            optimizer_full = gather_full_optimizer(source, saved_rows, shards)
    it = first["iteration"]
    full = {k: resize_vocab(v, padded) if k in VOCAB_PARAMS else v for k, v in full.items()}
    sharded_optimizer = zero_stage >= 1 and dp > 1
    for tp_rank in range(tp):
        for pp_rank in range(pp):
            directory = os.path.join(save, f"iter_{it:07d}", f"mp_rank_{tp_rank:02d}_{pp_rank:03d}")
            os.makedirs(directory, exist_ok=True)
            for dp_rank in range(dp if sharded_optimizer else 1):
                optimizer = None
                if optimizer_full is not None:
                    optimizer = shard_full_optimizer(config, padded, optimizer_full[0], optimizer_full[1],
                                                     tp_rank, pp_rank, dp_rank)
                state = {"iteration": it, "optimizer": optimizer}
                if dp_rank == 0:
                    state.update(consumed_samples=first["consumed_samples"], config=config.to_dict(),
                                 model=shard_full_state(full, config, tp_rank, pp_rank, padded),
                                 scheduler=first.get("scheduler"), dp_size=dp)
                path = os.path.join(directory, CHECKPOINT_FILE if dp_rank == 0 else f"optim_rng_dp_{dp_rank:03d}.pt")
                write_atomically(path, lambda f, s=state: torch.save(s, f))
    write_atomically(os.path.join(save, TRACKER_FILE), lambda f: f.write(f"{it}\n".encode()))
    return os.path.join(save, f"iter_{it:07d}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--load", required=True, help="source checkpoint directory")
    parser.add_argument("--save", required=True, help="where to write the resharded checkpoint")
    parser.add_argument("--target-tensor-model-parallel-size", type=int, required=True)
    parser.add_argument("--target-pipeline-model-parallel-size", type=int, required=True)
    parser.add_argument("--target-num-layers-per-virtual-pipeline-stage", type=int, default=None)
    parser.add_argument("--target-data-parallel-size", type=int, default=None,
                        help="data-parallel size the optimizer state is laid out for (default: the source's)")
    parser.add_argument("--target-zero-stage", type=int, default=None, choices=[0, 1, 2, 3],
                        help="ZeRO stage of the resumed run (default: the source's)")
    parser.add_argument("--no-optimizer", action="store_true", help="drop the optimizer state (Adam restarts)")
    parser.add_argument("--iteration", type=int, default=None, help="source iteration (default: the latest)")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="unpadded vocabulary (default: from the saved args or tokenizer)")
    args = parser.parse_args(argv)
    if os.path.abspath(args.load) == os.path.abspath(args.save):
        print("error: --save must differ from --load (the source stays as it is)", file=sys.stderr)
        return 2
    if is_torch_dist(checkpoint_iteration_dir(args.load, args.iteration)):
        print(f"error: {args.load} is a --ckpt-format torch_dist checkpoint, which loads at any layout as it is: "
              "resume with the new layout's flags and --load", file=sys.stderr)
        return 2
    try:
        path = reshard(args.load, args.save, args.target_tensor_model_parallel_size,
                       args.target_pipeline_model_parallel_size, args.target_num_layers_per_virtual_pipeline_stage,
                       args.iteration, args.vocab_size, args.target_data_parallel_size, args.target_zero_stage,
                       not args.no_optimizer)
    except ConfigError as error:
        print(f"error: target layout: {error}", file=sys.stderr)
        return 2
    print(f" > wrote {path} (tp {args.target_tensor_model_parallel_size}, pp "
          f"{args.target_pipeline_model_parallel_size}); resume with these layout flags and --load {args.save}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
