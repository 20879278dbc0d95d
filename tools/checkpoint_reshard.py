"""Convert a checkpoint between the torch and torch_dist formats and between parallel layouts.

    python tools/checkpoint_reshard.py --load ckpt/tp2pp2 --save ckpt/tp1 --ckpt-format torch \\
        --target-tensor-model-parallel-size 1 --target-pipeline-model-parallel-size 1

A torch_dist checkpoint needs no conversion to change layout: ``--load`` it with the new layout's flags.
This tool is for the torch format (one file per rank, readable at its own layout only) and for moving
between the formats. It converts with the trainer's own code: the processes of one layout build the model,
optimizer and lr schedule from the saved arguments as ``pretrain()`` does, ``load_checkpoint`` the source
and ``save_checkpoint`` it in the other format. torch_dist is the go-between, since DCP reads it at any
layout (docs/checkpoints.md):

* torch -> torch_dist: one pass at the source's layout (``--target-*`` flags are not needed);
* torch_dist -> torch: one pass at the target layout;
* torch -> torch at another layout: both passes, through a torch_dist copy in ``<save>/torch_dist_tmp``
  (removed at the end).

Each pass runs its tp x pp x dp processes under torchrun on this machine (CPU, gloo). Carried over:
weights, QAT ranges, fp32 masters, Adam moments and step (also of a CPU-offload optimizer), the loss
scaler, the lr schedule, iteration and consumed samples. RNG states only when the layout stays (DCP
restores them at the saved tp, pp, dp and ep); otherwise the resumed run keeps generators seeded from --seed.
MoE checkpoints change their expert-parallel size with ``--target-expert-model-parallel-size`` (the experts are
split over ep ranks inside the target's data parallelism, so ep divides ``--target-data-parallel-size``).
``--no-optimizer`` drops the optimizer state (Adam restarts, as with ``--no-load-optim``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_like.config import Config, ConfigError, QuietArgumentParser  # noqa: E402
from megatron_like.model.state import first_shard_dir, read_saved_config  # noqa: E402
from megatron_like.training.checkpointing import (  # noqa: E402
    CheckpointError,
    is_dist_checkpoint,
    iteration_dir,
    latest_iteration,
    rank_file,
)

TMP_DIR = "torch_dist_tmp"


def layout_config(saved: Config, tp: int, pp: int, vp_layers: int | None, dp: int, zero_stage: int,
                  offload: bool, ep: int | None = None) -> Config:
    """The saved config at another layout (validated: heads, layers and sizes must split). ``ep``: the MoE
    expert-parallel size (default: the saved one), which must divide ``dp``."""
    config = copy.deepcopy(saved)
    p = config.parallel
    p.tensor_model_parallel_size, p.pipeline_model_parallel_size = tp, pp
    p.expert_model_parallel_size = p.expert_model_parallel_size if ep is None else ep
    p.expert_tensor_parallel_size = None  # the torch format cuts experts over tp (etp = tp); torch_dist needs no pass
    p.num_layers_per_virtual_pipeline_stage = vp_layers
    if tp == 1:
        p.sequence_parallel = False
    p.zero_stage, p.use_distributed_optimizer, p.optimizer_cpu_offload = zero_stage, False, offload
    config.world_size = tp * pp * dp
    # Only the model split matters here; batch sizes are checked against dp when the run resumes.
    config.training.global_batch_size = config.training.micro_batch_size * dp * pp
    config.checkpoint.async_save, config.checkpoint.finetune = False, False
    config.checkpoint.load_rng = True
    config.validate()
    config.training.global_batch_size = saved.training.global_batch_size
    return config


def saved_layout(load: str, iteration: int) -> tuple[Config, int]:
    """(saved config, data-parallel size it was saved at)."""
    saved = read_saved_config(load, iteration)
    from megatron_like.training.checkpoint_validation import read_checkpoint_file  # one-line errors, weights only

    if is_dist_checkpoint(load, iteration):
        common = read_checkpoint_file(os.path.join(iteration_dir(load, iteration), "common.pt"))
        return saved, common.get("layout", {}).get("dp", 1)
    # The conversion pass's load verifies the file's checksums.
    first = read_checkpoint_file(rank_file(first_shard_dir(iteration_dir(load, iteration)), 0), mmap=True, verify=False)
    return saved, first.get("dp_size", 1)


def padded_vocab(config: Config, load: str, iteration: int, override: int | None) -> int:
    """The target's padded vocabulary: the real one (--vocab-size, the saved args' or the tokenizer's) padded
    for the target tp; without any, the saved rows (padding included)."""
    vocab = override if override is not None else config.model.vocab_size
    if vocab is None:
        try:
            from megatron_like.inference.loading import build_tokenizer_for

            tokenizer = build_tokenizer_for(config.data, None)
            vocab = tokenizer.vocab_size if tokenizer is not None else None
        except (OSError, ValueError, KeyError, ImportError) as error:
            print(f" > cannot build the saved tokenizer ({error}); keeping the saved vocabulary rows")
    if vocab is None:
        return saved_rows(load, iteration)
    return config.padded_vocab_size(vocab)


def saved_rows(load: str, iteration: int) -> int:
    """Rows of the saved word embedding (the saving layout's padded vocabulary)."""
    path = iteration_dir(load, iteration)
    if is_dist_checkpoint(load, iteration):
        from megatron_like.training.dist_checkpointing import open_dist_checkpoint  # the index, vetted

        _, index = open_dist_checkpoint(path)
        embedding = index.state_dict_metadata.get("model.embedding.word_embeddings.weight")
        if embedding is None:
            raise CheckpointError(f"checkpoint {path} has no model.embedding.word_embeddings.weight")
        return embedding.size[0]
    from megatron_like.training.checkpoint_validation import read_checkpoint_file  # one-line errors, weights only

    saved = read_saved_config(load, iteration)
    first = read_checkpoint_file(rank_file(first_shard_dir(path), 0), mmap=True, verify=False)
    return first["model"][0]["embedding.word_embeddings.weight"].shape[0] * saved.parallel.tensor_model_parallel_size


def convert(config: Config, load: str, save: str, ckpt_format: str, padded_vocab_size: int,
            with_optimizer: bool = True) -> int:
    """One pass, called by every rank of ``config``'s layout together: build the model, optimizer and lr
    schedule as ``pretrain()`` does, load the checkpoint under ``load`` and save it under ``save`` in
    ``ckpt_format``. Returns the iteration."""
    import pretrain_gpt
    from megatron_like.distributed import gathered_parameters
    from megatron_like.parallel_state import ParallelState
    from megatron_like.tensor_parallel import seed_everything
    from megatron_like.training.checkpoint_validation import validate_checkpoint
    from megatron_like.training.checkpointing import load_checkpoint, save_checkpoint
    from megatron_like.training.loop import build_model_chunks
    from megatron_like.training.lr_schedule import LearningRateScheduler
    from megatron_like.training.parallelize import parallelize

    config = copy.deepcopy(config)
    config.checkpoint.load_optim = config.checkpoint.save_optim = with_optimizer
    ps = ParallelState.initialize(config.parallel, config.world_size)
    seed_everything(config.training.seed, ps.tp_rank, ps.pp_rank, ps.device.type)
    provider = functools.partial(pretrain_gpt.model_provider, padded_vocab_size=padded_vocab_size)
    model = build_model_chunks(config, ps, provider)
    _, optimizer = parallelize(config, ps, model)
    scheduler = LearningRateScheduler(optimizer, config.optimizer, config.training.train_iters,
                                      use_checkpoint_values=True)
    validate_checkpoint(load, config, ps, model, optimizer)
    with gathered_parameters(model, write_back=True):
        iteration, consumed = load_checkpoint(load, config, ps, model, optimizer, scheduler)
    if not optimizer.master_loaded:
        optimizer.reload_model_params()
    config.checkpoint.ckpt_format = ckpt_format
    with gathered_parameters(model) if ckpt_format == "torch" else contextlib.nullcontext():
        save_checkpoint(save, iteration, config, ps, model, optimizer, scheduler, consumed)
    return iteration


def run_pass(config: Config, load: str, save: str, ckpt_format: str, padded_vocab_size: int,
             with_optimizer: bool) -> None:
    """:func:`convert` on ``config.world_size`` CPU processes under torchrun."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"config": config.to_dict(), "load": load, "save": save, "ckpt_format": ckpt_format,
                   "padded_vocab_size": padded_vocab_size, "with_optimizer": with_optimizer}, f)
    try:
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc_per_node={config.world_size}", os.path.abspath(__file__), "--pass-file", f.name]
        result = subprocess.run(command, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            # A checkpoint its ranks refused: their one line (the same on every rank), not the launcher's report.
            refused = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
            if refused:
                raise CheckpointError(refused[0][len("error: "):])
            raise CheckpointError(f"the conversion pass ({ckpt_format}, {config.world_size} processes) failed:\n"
                                  f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    finally:
        os.unlink(f.name)


def _run_pass_file(path: str) -> None:
    """A torchrun worker of :func:`run_pass`."""
    from megatron_like import collectives as comm
    from megatron_like.training.checkpoint_validation import exit_on_checkpoint_error

    with open(path) as f:
        job = json.load(f)
    config = Config.from_dict(job["config"])
    config.world_size = int(os.environ.get("WORLD_SIZE", "1"))
    with exit_on_checkpoint_error():  # `error: <one line>` on every rank, status 1
        convert(config, job["load"], job["save"], job["ckpt_format"], job["padded_vocab_size"], job["with_optimizer"])
    comm.shutdown()


def reshard(args: argparse.Namespace) -> str:
    """Write the latest checkpoint under ``args.load`` under ``args.save`` in ``args.ckpt_format`` (at the
    target layout for the torch format); returns the written iteration directory."""
    iteration = latest_iteration(args.load)
    if iteration is None:
        raise CheckpointError(f"--load {args.load} holds no latest_checkpointed_iteration.txt")
    if is_dist_checkpoint(args.load, iteration):  # its index vetted and its files there before any pass starts
        from megatron_like.training.dist_checkpointing import open_dist_checkpoint

        open_dist_checkpoint(iteration_dir(args.load, iteration))
    saved, saved_dp = saved_layout(args.load, iteration)
    p = saved.parallel
    source = layout_config(saved, p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                           p.num_layers_per_virtual_pipeline_stage, saved_dp, p.zero_stage, p.optimizer_cpu_offload)
    with_optimizer = not args.no_optimizer
    from_dist = is_dist_checkpoint(args.load, iteration)
    if from_dist and args.ckpt_format == "torch_dist":
        raise CheckpointError(f"{args.load} is a torch_dist checkpoint, which loads at any layout as it is: resume "
                              "with the new layout's flags and --load (or pass --ckpt-format torch)")
    if args.ckpt_format == "torch_dist":  # torch -> torch_dist at the saved layout
        run_pass(source, args.load, args.save, "torch_dist", saved_rows(args.load, iteration), with_optimizer)
        return iteration_dir(args.save, iteration)
    target = layout_config(
        saved, args.target_tensor_model_parallel_size or p.tensor_model_parallel_size,
        args.target_pipeline_model_parallel_size or p.pipeline_model_parallel_size,
        args.target_num_layers_per_virtual_pipeline_stage, args.target_data_parallel_size or saved_dp,
        p.zero_stage if args.target_zero_stage is None else args.target_zero_stage,
        args.target_optimizer_cpu_offload, args.target_expert_model_parallel_size)
    padded = padded_vocab(target, args.load, iteration, args.vocab_size)
    load = args.load
    if not from_dist:  # torch -> torch_dist at the saved layout, then on
        load = os.path.join(args.save, TMP_DIR)
        run_pass(source, args.load, load, "torch_dist", saved_rows(args.load, iteration), with_optimizer)
    run_pass(target, load, args.save, "torch", padded, with_optimizer)
    if not from_dist:
        shutil.rmtree(load)
    return iteration_dir(args.save, iteration)


def build_parser() -> argparse.ArgumentParser:
    parser = QuietArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--load", required=True, help="source checkpoint directory (either format)")
    parser.add_argument("--save", required=True, help="where to write the converted checkpoint")
    parser.add_argument("--ckpt-format", choices=("torch", "torch_dist"), default="torch",
                        help="format to write (default torch: the layout flags below apply; torch_dist loads at "
                             "any layout)")
    parser.add_argument("--target-tensor-model-parallel-size", type=int, default=None,
                        help="default: the source's")
    parser.add_argument("--target-pipeline-model-parallel-size", type=int, default=None,
                        help="default: the source's")
    parser.add_argument("--target-num-layers-per-virtual-pipeline-stage", type=int, default=None)
    parser.add_argument("--target-expert-model-parallel-size", type=int, default=None,
                        help="MoE: experts split over this many ranks inside data parallelism (default: the source's)")
    parser.add_argument("--target-data-parallel-size", type=int, default=None,
                        help="data-parallel size the optimizer state is laid out for (default: the source's)")
    parser.add_argument("--target-zero-stage", type=int, default=None, choices=[0, 1, 2, 3],
                        help="ZeRO stage of the resumed run (default: the source's)")
    parser.add_argument("--target-optimizer-cpu-offload", action="store_true",
                        help="lay the optimizer state out for --optimizer-cpu-offload")
    parser.add_argument("--no-optimizer", action="store_true", help="drop the optimizer state (Adam restarts)")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="unpadded vocabulary (default: from the saved args or tokenizer)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--pass-file"]:
        _run_pass_file(argv[1])
        return 0
    args = build_parser().parse_args(argv)
    if os.path.abspath(args.load) == os.path.abspath(args.save):
        print("error: --save must differ from --load (the source stays as it is)", file=sys.stderr)
        return 2
    try:
        path = reshard(args)
    except ConfigError as error:
        print(f"error: target layout: {error}", file=sys.stderr)
        return 2
    except CheckpointError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f" > wrote {path}; resume with --load {args.save}" + (
        " and the target layout's flags" if args.ckpt_format == "torch" else " at any layout"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
