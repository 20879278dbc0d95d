"""Bad steps under 2 data-parallel processes: caught on every rank, skipped, logged, rerun (training/bad_steps.py).

One process group runs every in-process training of the first test (spawning costs more than a run). The
reference is a run where global batch 2 never reaches the model: its ranks discard their share of it, and it
stops after 3 steps (``--exit-interval``) of the same 4-iteration lr schedule. A run whose iteration 2 is skipped
must end with exactly its weights (the skip moves neither the weights, nor Adam's moments and step, nor the
schedule). The exit statuses and the restart are tested on the script (``pretrain_gpt.py``), as a launcher sees it.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import re
from pathlib import Path

import torch

from tests.distributed.gpt_runs import train_gpt
from tests.distributed.harness import run_distributed
from tests.e2e.cli import _run_script_rank, launch, logged_losses

FLAGS = ["--num-layers", "2", "--train-iters", "4", "--global-batch-size", "8"]
"""2 ranks of data parallelism, 2 micro batches of 2 samples per rank and step."""
MICRO_BATCHES_PER_STEP = 2


def _forward_step_without_batch(skipped_step: int):
    """pretrain_gpt's forward step, but each rank draws (and drops) its micro batches of step ``skipped_step``."""
    import pretrain_gpt

    calls = 0

    def forward_step(data_iterator, model):
        nonlocal calls
        if calls == (skipped_step - 1) * MICRO_BATCHES_PER_STEP:
            for _ in range(MICRO_BATCHES_PER_STEP):
                next(data_iterator)
        calls += 1
        return pretrain_gpt.forward_step(data_iterator, model)

    return forward_step


def _run(rank: int, world_size: int, flags: list[str], **kwargs) -> dict:
    """train_gpt with its stdout captured (rank 0 logs the skipped batches)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = train_gpt(rank, world_size, FLAGS + flags, **kwargs)
    result["stdout"] = out.getvalue()
    return result


def bad_step_runs(rank: int, world_size: int) -> dict[str, dict]:
    runs = {"reference": _run(rank, world_size, ["--exit-interval", "3"],
                              forward_step=_forward_step_without_batch(2))}
    runs["nan_loss"] = _run(rank, world_size, ["--inject-fault", "nan_loss@2"])
    runs["nan_grad"] = _run(rank, world_size, ["--inject-fault", "nan_grad@2:1"])
    # ZeRO-1: the verdict rides on the norm's reduction over dp (another path than plain dp's own flag reduction).
    runs["nan_grad_zero1"] = _run(rank, world_size, ["--zero-stage", "1", "--inject-fault", "nan_grad@2:0"])
    runs["rerun"] = _run(rank, world_size, ["--rerun-mode", "validate_results", "--inject-fault", "nan_loss@2"])
    runs["spike"] = _run(rank, world_size, ["--rerun-mode", "validate_results", "--inject-fault", "loss_spike@3"])
    # 2 pipeline stages: only the last knows the loss; the first learns the verdict from the norm's reduction.
    runs["spike_pp2"] = _run(rank, world_size, ["--pipeline-model-parallel-size", "2", "--rerun-mode",
                                                 "validate_results", "--inject-fault", "loss_spike@3"])
    return runs


def test_bad_steps_are_skipped_on_every_rank_and_leave_the_weights_of_a_run_without_that_batch():
    ranks = run_distributed(bad_step_runs, 2)
    reference = ranks[0]["reference"]["params"]
    for name, expected_bad in [("nan_loss", [2]), ("nan_grad", [2]), ("rerun", [2]), ("spike", [3])]:
        for rank, runs in enumerate(ranks):
            run = runs[name]
            assert run["bad_iterations"] == expected_bad, f"{name}, rank {rank}: {run['bad_iterations']}"
            for param, value in run["params"].items():
                assert torch.isfinite(value).all(), f"{name}, rank {rank}: {param} is not finite"
                if name != "spike":  # the spike run skips iteration 3: another batch is missing
                    assert torch.equal(value, reference[param]), f"{name}, rank {rank}: {param} differs from " \
                                                                 "the run without batch 2"
        assert torch.equal(ranks[0][name]["params"]["embedding.word_embeddings.weight"],
                           ranks[1][name]["params"]["embedding.word_embeddings.weight"])
    assert [runs["spike_pp2"]["bad_iterations"] for runs in ranks] == [[3], [3]]
    zero1 = [runs["nan_grad_zero1"] for runs in ranks]
    assert [run["bad_iterations"] for run in zero1] == [[2], [2]]
    for param, value in zero1[0]["params"].items():
        assert torch.isfinite(value).all() and torch.equal(value, zero1[1]["params"][param]), param
    log = ranks[0]["rerun"]["stdout"]
    # Global batch 2 holds samples 8..15: --global-batch-size 8 from 8 consumed samples.
    assert re.search(r"skipped iteration 2: .*reproduced by its rerun.*samples \[8, 16\)", log), log
    assert "reproduced by its rerun" in ranks[0]["spike"]["stdout"], ranks[0]["spike"]["stdout"]
    assert math.isnan(ranks[1]["nan_loss"]["losses"][1])


def _script(flags: list[str]) -> list[tuple[int, str, str]]:
    """pretrain_gpt.py on 2 forked ranks: (exit status, stdout, stderr) of each."""
    return run_distributed(_run_script_rank, 2, "pretrain_gpt.py", TINY + flags, True, False)


TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
        "--micro-batch-size", "1", "--mock-data", "--vocab-size", "128", "--make-vocab-size-divisible-by", "8",
        "--log-interval", "1", "--eval-iters", "0", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--ckpt-format", "torch", "--num-workers", "0"]


def test_bad_steps_in_a_row_save_and_exit_17(tmp_path):
    ranks = _script(["--train-iters", "6", "--inject-fault", "nan_loss@2", "--inject-fault", "nan_loss@3",
                     "--max-skipped-steps", "2", "--save", str(tmp_path)])
    assert [code for code, _, _ in ranks] == [17, 17], ranks
    assert "2 bad iterations in a row" in ranks[0][1]
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "3"


def _weights(root: Path, iteration: int) -> dict[str, torch.Tensor]:
    state = torch.load(root / f"iter_{iteration:07d}" / "mp_rank_00_000" / "model_optim_rng.pt", weights_only=True)
    return state["model"][0]


def _restarted_rank(rank: int, world_size: int, *args) -> tuple[int, str, str]:
    """``_run_script_rank`` as a worker of a job its launcher restarted once (torchrun's restart count is 1)."""
    os.environ["TORCHELASTIC_RESTART_COUNT"] = "1"
    return _run_script_rank(rank, world_size, *args)


def test_transient_fault_exits_16_and_a_restart_ends_as_a_straight_run(tmp_path):
    straight, saved = tmp_path / "straight", tmp_path / "saved"
    launch(2, TINY + ["--train-iters", "5", "--hidden-dropout", "0.1", "--save", str(straight)])
    # Dropout on: the rerun must draw the masks of the first execution (the generators put back).
    flags = ["--train-iters", "5", "--hidden-dropout", "0.1", "--rerun-mode", "validate_results",
             "--inject-fault", "transient@3", "--save", str(saved), "--load", str(saved)]
    # What the launcher sees: status 16 after a checkpoint of iteration 3 (the clean rerun's update is kept).
    ranks = _script(flags)
    assert [code for code, _, _ in ranks] == [16, 16], ranks
    assert "a transient fault" in ranks[0][1] and "holds no checkpoint" in ranks[0][1], ranks[0][1]
    assert (saved / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    # The restart torchrun --max-restarts 1 starts on that status (the same command, TORCHELASTIC_RESTART_COUNT 1;
    # torchrun's own restart is tested in tests/e2e/test_fault.py): it resumes at iteration 3 and finishes with the
    # straight run's weights.
    ranks = run_distributed(_restarted_rank, 2, "pretrain_gpt.py", TINY + flags, True, False)
    assert [code for code, _, _ in ranks] == [0, 0], ranks
    out = "".join(stdout for _, stdout, _ in ranks)
    assert "loaded checkpoint" in out and "a transient fault" not in out, out
    assert sorted(logged_losses(out)) == [4, 5], out
    expected, got = _weights(straight, 5), _weights(saved, 5)
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


def test_straggler_line_names_the_slow_rank():
    ranks = _script(["--train-iters", "4", "--log-interval", "2", "--log-straggler",
                     "--inject-fault", "slow@1:1"])
    assert [code for code, _, _ in ranks] == [0, 0], ranks
    out = ranks[0][1]
    assert out.count("straggler report at iteration") == 2, out
    assert re.search(r"WARNING: straggler: rank 1 on host \S+ computes", out), out
    assert "straggler: rank 0" not in out, out
