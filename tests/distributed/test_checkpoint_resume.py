"""Resuming from a checkpoint continues exactly: 4 steps straight == 2 steps + save + load + 2 steps.

Layouts: tp2 x pp2, pp2 under the zero-bubble schedules ZB-H1, ZB-V and DualPipeV (two chunks per rank in a V),
and ZeRO-2 over dp2 (every dp rank saves its own
optimizer shard and RNG states), also with the optimizer offloaded to the CPU (CPUAdam's moments and step counts),
and ZeRO-3 over dp2 (the model is built deferred and drawn into the shards, then the checkpoint is loaded into the
gathered units); in the torch format and in torch_dist (global tensors through torch.distributed.checkpoint,
test_dist_checkpoint.py). Every layout of one world size runs in one process group, the straight run once for both
formats.
"""

from __future__ import annotations

import functools
import os
import tempfile

import pytest

from tests.distributed.gpt_runs import train_gpt
from tests.distributed.harness import run_distributed

# Dropout on, so the restored RNG states (default stream and the tp tracker) matter; the lr schedule
# spans 4 iterations in every run so the 2-iteration run warms up and decays the same way. Two steps before the
# save leave Adam's moments and step count, the schedule and the generators past their first step.
RESUME_FLAGS = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--lr-decay-iters", "4",
                "--lr-warmup-iters", "1", "--lr-decay-style", "cosine"]
STRAIGHT, SAVED = 4, 2


TP2_PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
ZERO2_OFFLOAD = ["--zero-stage", "2", "--optimizer-cpu-offload"]
LAYOUTS = {  # name: (world size, layout, checkpoint format)
    "tp2-pp2": (4, TP2_PP2, "torch"),
    "zero2-dp2": (2, ["--zero-stage", "2"], "torch"),
    "zero2-dp2-offload": (2, ZERO2_OFFLOAD, "torch"),
    "zero3-dp2": (2, ["--zero-stage", "3"], "torch"),
    "tp2-pp2-torch_dist": (4, TP2_PP2, "torch_dist"),
    "zero2-dp2-offload-torch_dist": (2, ZERO2_OFFLOAD, "torch_dist"),
    "pp2-zb-h1": (2, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1"], "torch"),
    "pp2-zb-v": (2, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-v"], "torch"),
    "pp2-dualpipev-torch_dist": (2, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "dualpipev"],
                                 "torch_dist"),
    # the dropout sites' generators (model/dropout.py) are saved and resumed with the tracker's streams
    "pp2-layout-independent-dropout": (2, ["--pipeline-model-parallel-size", "2", "--dropout-rng",
                                           "layout-independent"], "torch"),
}


def straight_and_resumed(rank: int, world_size: int, cases: dict[str, tuple[list[str], str]], root: str) -> dict:
    """For each case ``{name: (layout, format)}``: the losses of STRAIGHT straight steps, of SAVED steps that save
    and of the ones more that load them; the straight run (which saves nothing) once per layout."""
    out, straight = {}, {}
    for name, (layout, fmt) in cases.items():
        flags = RESUME_FLAGS + layout + ["--ckpt-format", fmt]
        if tuple(layout) not in straight:
            straight[tuple(layout)] = train_gpt(rank, world_size, flags + ["--train-iters", str(STRAIGHT)])["losses"]
        save = os.path.join(root, name)
        first = train_gpt(rank, world_size, flags + ["--train-iters", str(SAVED), "--save", save])
        resumed = train_gpt(rank, world_size, flags + ["--train-iters", str(STRAIGHT), "--load", save])
        out[name] = {"straight": straight[tuple(layout)], "first": first["losses"], "resumed": resumed["losses"],
                     "saved": os.path.exists(os.path.join(save, "latest_checkpointed_iteration.txt"))}
    return out


@functools.cache
def resume_runs(world_size: int) -> dict[str, list[dict]]:
    """Every layout of ``world_size`` processes in one process group: ``{name: [each rank's result]}``."""
    cases = {name: (layout, fmt) for name, (size, layout, fmt) in LAYOUTS.items() if size == world_size}
    with tempfile.TemporaryDirectory() as root:
        results = run_distributed(straight_and_resumed, world_size, cases, root, timeout=600)
    return {name: [r[name] for r in results] for name in cases}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_resume_gives_bitwise_equal_losses(name):
    results = resume_runs(LAYOUTS[name][0])[name]
    assert all(r["saved"] for r in results)
    with_loss = [r for r in results if r["straight"]]
    assert with_loss
    for r in with_loss:
        assert len(r["straight"]) == STRAIGHT and len(r["first"]) == SAVED and len(r["resumed"]) == STRAIGHT - SAVED
        assert r["first"] == r["straight"][:SAVED]
        assert r["resumed"] == r["straight"][SAVED:], "resumed run diverged from the straight run"


# ------------------------------------------------------------------ resuming with changed arguments
SCHEDULE = ["--lr-decay-style", "linear", "--lr-warmup-iters", "0"]  # lr after step k: 1e-3 * (1 - k / decay)


def resume_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(" > resuming with changed arguments")]


def logged_lr(out: str, iteration: int) -> str:
    line = next(line for line in out.splitlines() if line.startswith(f" iteration {iteration:8d}/"))
    return line.split("learning rate: ")[1].split(" ")[0]


def test_resume_with_changed_arguments_says_what_changed_and_what_follows(tmp_path, capsys):
    train_gpt(0, 1, SCHEDULE + ["--train-iters", "2", "--save", str(tmp_path)])
    capsys.readouterr()
    resumed = train_gpt(0, 1, SCHEDULE + ["--train-iters", "4", "--lr-decay-iters", "10", "--global-batch-size",
                                          "4", "--seq-length", "8", "--seed", "7", "--load", str(tmp_path),
                                          "--override-opt_param-scheduler"])
    assert len(resumed["losses"]) == 2, "a smaller batch after 2 x 8 consumed samples still has data"
    (line,) = resume_lines(capsys.readouterr().out)
    for change in ("--train-iters 2 -> 4", "--lr-decay-iters None -> 10", "--global-batch-size 8 -> 4",
                   "--seq-length 16 -> 8", "--seed 1234 -> 7"):
        assert change in line, line
    assert "training ends at iteration 4" in line
    assert "the lr schedule is recomputed from this run's flags (warmup 0, linear decay to 0 by iteration 10" in line
    assert "the data order changes" in line


def test_resume_with_the_same_schedule_mentions_no_lr_or_data_change(tmp_path, capsys):
    flags = SCHEDULE + ["--lr-decay-iters", "4"]
    train_gpt(0, 1, flags + ["--train-iters", "2", "--save", str(tmp_path)])
    capsys.readouterr()
    train_gpt(0, 1, flags + ["--train-iters", "4", "--load", str(tmp_path)])
    (line,) = resume_lines(capsys.readouterr().out)
    assert line.endswith("--train-iters 2 -> 4: training ends at iteration 4"), line
    train_gpt(0, 1, flags + ["--train-iters", "2", "--load", str(tmp_path)])  # nothing changed: no line
    assert resume_lines(capsys.readouterr().out) == []


@pytest.fixture(scope="module")
def schedule_runs(tmp_path_factory) -> dict:
    """4 steps with linear decay over 4, vs 2 steps + resume with --lr-decay-iters 8 under each policy."""
    import contextlib
    import io

    root = str(tmp_path_factory.mktemp("ckpt"))
    flags = SCHEDULE + ["--lr-decay-iters", "4"]
    out: dict = {}
    for name, run_flags in {
        "straight": flags + ["--train-iters", "4"],
        "first": flags + ["--train-iters", "2", "--save", root],
        "override": SCHEDULE + ["--lr-decay-iters", "8", "--train-iters", "4", "--load", root,
                                "--override-opt_param-scheduler"],
        "use-checkpoint": SCHEDULE + ["--lr-decay-iters", "8", "--train-iters", "4", "--load", root,
                                      "--use-checkpoint-opt_param-scheduler"],
    }.items():
        log = io.StringIO()
        with contextlib.redirect_stdout(log):
            out[name] = (train_gpt(0, 1, run_flags)["losses"], log.getvalue())
    out["root"] = root
    return out


def test_use_checkpoint_opt_param_scheduler_keeps_the_checkpoints_schedule(schedule_runs):
    straight, _ = schedule_runs["straight"]
    losses, log = schedule_runs["use-checkpoint"]
    assert losses == straight[2:], "the checkpoint's schedule continues exactly"
    assert logged_lr(log, 3) == "2.500000E-04"  # 1e-3 * (1 - 3/4)
    assert "the lr schedule stays the checkpoint's (--use-checkpoint-opt_param-scheduler)" in resume_lines(log)[0]


def test_a_changed_schedule_without_a_scheduler_flag_is_refused(schedule_runs):
    """Megatron-LM's rule: neither --override-opt_param-scheduler nor --use-checkpoint-opt_param-scheduler, and the
    flags define another schedule than the checkpoint's: refused in one line before any weight is loaded."""
    from megatron_like.training.checkpointing import CheckpointError

    with pytest.raises(CheckpointError) as refused:
        train_gpt(0, 1, SCHEDULE + ["--lr-decay-iters", "8", "--train-iters", "4", "--load", schedule_runs["root"]])
    message = str(refused.value)
    assert "\n" not in message and "decay_iters 4 -> 8" in message, message
    assert "--override-opt_param-scheduler" in message and "--use-checkpoint-opt_param-scheduler" in message


def test_override_opt_param_scheduler_recomputes_the_schedule_from_this_runs_flags(schedule_runs):
    straight, _ = schedule_runs["straight"]
    losses, log = schedule_runs["override"]
    assert logged_lr(log, 3) == "6.250000E-04"  # 1e-3 * (1 - 3/8): the step count from the checkpoint
    assert losses[0] == straight[2] and losses[1] != straight[3]  # iteration 3 already stepped with another lr
    assert "the lr schedule is recomputed from this run's flags" in resume_lines(log)[0]


def test_both_scheduler_policies_at_once_are_refused():
    from megatron_like.config import ConfigError, parse_config
    from tests.distributed.gpt_runs import BASE_FLAGS

    with pytest.raises(ConfigError, match="exclude each other"):
        parse_config(BASE_FLAGS + ["--override-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler"])
