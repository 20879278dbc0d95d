"""Activation recomputation gives bitwise the same gradients as none, with dropout on.

Full (uniform and block) and selective recompute re-run forward inside backward; the recompute-safe
``checkpoint`` restores the default generator and the tracker streams, so every dropout mask is drawn
again identically. Checked directly on one model's gradients, and through pretrain() with tp=2 +
sequence parallelism (per-tp-rank tracker streams) and with pp=2 (per-stage layers), where the
losses and updated weights of every recompute mode must equal the run without recompute exactly.
"""

from __future__ import annotations

import functools

import pytest
import torch

from megatron_like.config import parse_config
from megatron_like.model import GPTModel
from megatron_like.parallel_state import ParallelState
from megatron_like.tensor_parallel import seed_everything
from tests.distributed.gpt_runs import train_gpt_many
from tests.distributed.harness import run_distributed

DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
FULL = ["--recompute-granularity", "full", "--recompute-method"]
MODES = {
    "none": [],
    "full-uniform-1": FULL + ["uniform", "--recompute-num-layers", "1"],
    "full-uniform-3": FULL + ["uniform", "--recompute-num-layers", "3"],
    "full-block-2": FULL + ["block", "--recompute-num-layers", "2"],
    "selective": ["--recompute-granularity", "selective"],
}


@functools.cache
def _model_gradients(flags: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Gradients of one forward/backward of a 4-layer GPT with dropout 0.1 (fixed weights and batch;
    ``--seed`` seeds the dropout streams only)."""
    config = parse_config(["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length",
                           "16", "--mock-data", "--vocab-size", "128", *DROPOUT, *flags], world_size=1)
    ps = ParallelState.single_process(torch.device("cpu"))
    seed_everything(config.training.seed, 0, 0)
    model = GPTModel(config.model, ps, vocab_size=128, seed=1234)
    tokens = torch.randint(0, 128, (3, 17), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16).expand(3, 16)
    model.train()
    model(tokens[:, :-1], positions, labels=tokens[:, 1:]).mean().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def model_gradients(flags: list[str]) -> dict[str, torch.Tensor]:
    return _model_gradients(tuple(flags))


@pytest.mark.parametrize("mode", [m for m in MODES if m != "none"])
def test_recompute_gradients_are_bitwise_equal_with_dropout(mode: str) -> None:
    expected = model_gradients(MODES["none"])
    got = model_gradients(MODES[mode])
    assert set(got) == set(expected)
    for name, grad in expected.items():
        assert torch.equal(got[name], grad), f"{mode}: gradient of {name} differs"
    # Dropout really was on: another seed changes the gradients.
    other_masks = model_gradients(["--seed", "7"])
    assert not torch.equal(expected["layers.0.mlp.fc1.weight"], other_masks["layers.0.mlp.fc1.weight"])


LAYOUTS = {
    "tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
}
TRAINING_MODES = ["none", "full-uniform-1", "full-block-2", "selective"]


@functools.cache
def training_runs() -> dict[tuple[str, str], list[dict]]:
    """Every (layout, mode) trained on 2 processes in one process group; per-rank results."""
    keys = [(layout, mode) for layout in LAYOUTS for mode in TRAINING_MODES]
    flag_lists = [DROPOUT + ["--train-iters", "2"] + LAYOUTS[layout] + MODES[mode] for layout, mode in keys]
    per_rank = run_distributed(train_gpt_many, 2, flag_lists, timeout=600)
    return {key: [rank_results[i] for rank_results in per_rank] for i, key in enumerate(keys)}


@pytest.mark.parametrize("layout,mode", [(lay, m) for lay in LAYOUTS for m in TRAINING_MODES if m != "none"])
def test_recompute_training_is_bitwise_equal(layout: str, mode: str) -> None:
    runs = training_runs()
    for expected, got in zip(runs[(layout, "none")], runs[(layout, mode)]):
        assert got["losses"] == expected["losses"]
        assert got["grad_norms"] == expected["grad_norms"]
        for name, tensor in expected["params"].items():
            assert torch.equal(got["params"][name], tensor), f"{layout} {mode}: {name} differs"
