"""Shared command-line plumbing of the inference tools: the config flags plus tool flags, process
groups, loading the checkpoint, printing on one rank.

Tools build their parser from ``megatron_like.config.build_parser()`` (so ``--load``,
``--tensor-model-parallel-size``, ``--tokenizer-type``, ``--vocab-file``... keep their Megatron names) and
add their own flags to it.
"""

from __future__ import annotations

import argparse
import os

import torch

from megatron_like import collectives as comm
from megatron_like.config import Config, ConfigError, build_parser, config_from_namespace, print_once
from megatron_like.config.fields import check_declared
from megatron_like.inference.loading import InferenceModel, load_inference_model
from megatron_like.model.state import CheckpointLoadError
from megatron_like.parallel_state import ParallelState
from megatron_like.training.checkpointing import CheckpointError


def inference_parser(description: str) -> argparse.ArgumentParser:
    """``build_parser()`` with this tool's description (tools add a group of their own flags)."""
    parser = build_parser(description)
    parser.add_argument("--iteration", type=int, default=None,
                        help="Load this iteration instead of the latest checkpointed one.")
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> tuple[argparse.Namespace, Config]:
    """Parse ``argv``: the tool's own flags (namespace) and the config flags (not validated as a training run; each
    flag's declared range and needed flags are checked, before any process group)."""
    args = parser.parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    config = config_from_namespace(args, world_size)
    if config.checkpoint.load is None:
        parser.error("--load <checkpoint dir> is required")
    try:
        check_declared(config.groups())
    except ConfigError as error:
        fail(str(error))
    return args, config


def setup(config: Config, data_parallel: bool = False) -> ParallelState:
    """Start the process groups of a tp x pp (x ep) layout: one model replica, or with ``data_parallel`` (the
    evaluation, which splits its batches) as many replicas as the world holds.

    A model whose experts are split over ``--expert-model-parallel-size`` ep ranks spans tp x pp x ep
    processes: the ep ranks hold different experts and replicate the rest (docs/moe.md)."""
    p = config.parallel
    if p.context_parallel_size > 1:
        raise ConfigError(f"--context-parallel-size {p.context_parallel_size}: generation, serving and evaluation run "
                          "without context parallelism; drop the flag (a cp-trained checkpoint loads at cp 1)")
    tp, pp, ep = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.expert_model_parallel_size
    sizes = f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp}" + (
        f" x --expert-model-parallel-size {ep}" if ep > 1 else "")
    if data_parallel and config.world_size % (tp * pp * ep):
        raise ConfigError(f"the world size {config.world_size} is not a multiple of {sizes} = {tp * pp * ep} "
                          "(one model replica)")
    if not data_parallel and config.world_size != tp * pp * ep:
        raise ConfigError(f"this tool runs one model replica: launch {sizes} = {tp * pp * ep} processes, "
                          f"not {config.world_size}")
    return ParallelState.initialize(p, config.world_size)


def load(config: Config, ps: ParallelState, iteration: int | None = None) -> InferenceModel:
    """This rank's chunk of the checkpoint ``--load`` in the layout of ``ps``.

    Ranks of different pipeline stages read different files: when one finds a broken file, every rank
    raises its one-line CheckpointError (none waits for it in generation)."""
    try:
        loaded, error = load_inference_model(config.checkpoint.load, ps, cli_data=config.data, iteration=iteration,
                                             dtype=getattr(torch, config.params_dtype_name),
                                             given_model=config.model), None
    except (CheckpointError, CheckpointLoadError) as problem:
        loaded, error = None, str(problem)
    agreed = comm.first_error(error, comm.world_group(), ps.device)
    if agreed is not None:
        raise CheckpointError(agreed)
    return loaded


def fail(message: str, code: int = 2) -> None:
    """Print ``error: message`` once (rank 0) and exit."""
    print_once(f"error: {message}")
    raise SystemExit(code)
