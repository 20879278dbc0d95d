"""pretrain_gpt.py --load of a Megatron-LM checkpoint, no conversion step: our run saved at iteration 3, written in
Megatron-LM's files (tools/convert_megatron.py), continues from them at another layout with the losses of the
uninterrupted run (torch_dist, at tp 2 x dp 2 with ZeRO-1, and the legacy files at pp 2: weights, AdamW moments and
step, lr schedule, consumed samples; with --ckpt-naming megatron at tp 2 with dropout also the RNG states)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from megatron_like.training.checkpointing import write_tracker
from megatron_like.training.megatron_format import read_megatron_file
from tests.e2e.cli import ISSUE_FLAGS, launch, logged_losses, run_script

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import convert_megatron  # noqa: E402

FLAGS = ISSUE_FLAGS + ["--lr-decay-style", "cosine", "--lr-warmup-iters", "2"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """(our checkpoint directory naming iteration 3, the uninterrupted run's losses)."""
    save = str(tmp_path_factory.mktemp("ours") / "ckpt")
    losses = logged_losses(launch(1, FLAGS + ["--ckpt-format", "torch_dist", "--save", save, "--save-interval", "3"]))
    write_tracker(save, 3)
    return save, losses


def _to_megatron(ours: str, mlm: str, *flags: str) -> None:
    convert_megatron.main(["--direction", "to-megatron", "--load", ours, "--save", mlm, "--iteration", "3", *flags])


def test_cli_continues_a_megatron_torch_dist_checkpoint_with_its_optimizer(tmp_path, straight):
    ours, losses = straight
    mlm = str(tmp_path / "mlm")
    _to_megatron(ours, mlm, "--target-tensor-parallel-size", "2")
    # tp 2 x dp 2 with ZeRO-1: each rank copies its flat optimizer shards' boxes out of the whole tensors
    out = launch(4, FLAGS + ["--tensor-model-parallel-size", "2", "--zero-stage", "1", "--load", mlm])
    assert f" > loaded checkpoint from {mlm} at iteration 3" in out
    resumed = logged_losses(out)
    assert sorted(resumed) == [4, 5, 6]
    for iteration, loss in resumed.items():
        assert loss == pytest.approx(losses[iteration], rel=1e-5), f"iteration {iteration}"


def test_cli_continues_a_megatron_legacy_checkpoint_with_its_optimizer(tmp_path, straight):
    """Legacy files at pp 2: each rank's ``optimizer`` entry (Megatron-LM's non-distributed optimizer: AdamW's state
    dict in its parameter order) carries the moments and step; the run continues with the uninterrupted losses."""
    ours, losses = straight
    mlm = str(tmp_path / "mlm")
    _to_megatron(ours, mlm, "--ckpt-format", "torch", "--target-pipeline-model-parallel-size", "2")
    out = launch(2, FLAGS + ["--pipeline-model-parallel-size", "2", "--load", mlm])
    resumed = logged_losses(out)
    assert sorted(resumed) == [4, 5, 6]
    for iteration, loss in resumed.items():
        assert loss == pytest.approx(losses[iteration], rel=1e-5), f"iteration {iteration}"
    refused = run_script("pretrain_gpt.py", *FLAGS, "--load", mlm, "--num-layers", "3", check=False)
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error: ")]
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr
    assert errors == [f"error: Megatron-LM checkpoint {mlm}/iter_0000003 has --num-layers 2 but this run has 3; "
                      "pass the checkpoint's value"], refused.stderr


def test_cli_continues_a_megatron_checkpoint_of_a_bf16_run_with_its_fp32_masters(tmp_path):
    """bf16 parameters: the fp32 masters travel as Megatron-core's ``fp32_param`` and come back as ours (from the
    bf16 weights the run would lose its masters' low bits and part from the uninterrupted run)."""
    flags = FLAGS + ["--bf16"]
    ours, mlm = str(tmp_path / "ours"), str(tmp_path / "mlm")
    straight = logged_losses(launch(1, flags + ["--save", ours, "--save-interval", "3"]))
    _to_megatron(ours, mlm)
    resumed = logged_losses(launch(2, flags + ["--zero-stage", "1", "--load", mlm]))
    assert sorted(resumed) == [4, 5, 6]
    for iteration, loss in resumed.items():
        assert loss == pytest.approx(straight[iteration], rel=1e-5), f"iteration {iteration}"


def _same(a, b) -> bool:
    """Whether two checkpoint entries hold the same values: tensors (and dtypes), numpy arrays, args, containers."""
    import argparse

    import numpy as np

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return type(a) is type(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return type(a) is type(b) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, argparse.Namespace):
        return isinstance(b, argparse.Namespace) and _same(vars(a), vars(b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _megatron_files(root: str, iteration: int) -> tuple[dict, dict]:
    """(every DCP entry of a Megatron-LM torch_dist iteration: tensors and objects, its ``common.pt`` with ``args``
    as a dict)."""
    from megatron_like.training.checkpoint_integrity import read_dcp_metadata
    from megatron_like.training.dist_checkpointing import read_full_tensors
    from megatron_like.training.megatron_format import safe_globals

    it_dir = os.path.join(root, f"iter_{iteration:07d}")
    keys = sorted(read_dcp_metadata(it_dir).state_dict_metadata)
    with torch.serialization.safe_globals(safe_globals()):
        entries = read_full_tensors(root, keys, iteration)
    common = read_megatron_file(os.path.join(it_dir, "common.pt"))
    return entries, common


def test_cli_saves_in_megatron_naming_and_resumes_with_its_rng_states(tmp_path):
    """--ckpt-naming megatron at tp 2 with dropout on: the files are the converter's of an ours-named save of the
    same run (every key, value, RNG state, common entry; torch_dist, and the legacy files of a run that exits at
    iteration 3), and --load of them continues with the uninterrupted run's losses, its dropout streams included
    (python, numpy, torch and the tensor-parallel tracker from rng_state)."""
    flags = FLAGS + ["--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--tensor-model-parallel-size", "2"]
    mlm, ours, exported = (str(tmp_path / name) for name in ("mlm", "ours", "exported"))
    straight = logged_losses(launch(2, flags + ["--ckpt-naming", "megatron", "--save", mlm, "--save-interval", "3"]))
    launch(2, flags + ["--save", ours, "--exit-interval", "3"])
    _to_megatron(ours, exported)
    assert os.path.isfile(os.path.join(mlm, "iter_0000003", "metadata.json"))
    assert not os.path.exists(os.path.join(mlm, ".megatron_staging"))
    (entries, common), (expected, expected_common) = _megatron_files(mlm, 3), _megatron_files(exported, 3)
    assert sorted(entries) == sorted(expected)
    assert {"rng_state/shard_0.1_1.2", "optimizer.state.exp_avg.embedding.word_embeddings.weight"} <= set(entries)
    for key, value in entries.items():
        assert _same(value, expected[key]), key
    assert _same(common, expected_common)
    legacy, legacy_export = str(tmp_path / "legacy"), str(tmp_path / "legacy_export")
    launch(2, flags + ["--ckpt-naming", "megatron", "--ckpt-format", "torch", "--save", legacy, "--exit-interval", "3"])
    _to_megatron(ours, legacy_export, "--ckpt-format", "torch")
    for rank in ("mp_rank_00", "mp_rank_01"):
        files = [read_megatron_file(os.path.join(root, "iter_0000003", rank, "model_optim_rng.pt"))
                 for root in (legacy, legacy_export)]
        assert {"rng_state", "optimizer", "opt_param_scheduler"} <= files[0].keys()
        assert _same(*files), rank
    write_tracker(mlm, 3)
    resumed = logged_losses(launch(2, flags + ["--load", mlm]))
    assert sorted(resumed) == [4, 5, 6]
    for iteration, loss in resumed.items():
        assert loss == pytest.approx(straight[iteration], rel=1e-5), f"iteration {iteration}"
