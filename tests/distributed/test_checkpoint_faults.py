"""A save interrupted anywhere leaves the latest checkpoint loadable (single process, no process group).

Two ways to interrupt: a fault injected at each crash point of ``save_checkpoint`` (every point, every
save), and a forked process saving in a loop that is SIGKILLed at random moments (25 trials). After each
interruption ``load_checkpoint`` must succeed and give the weights of the iteration the tracker names.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time

import pytest
import torch

from megatron_like.config import parse_config
from megatron_like.model import GPTModel
from megatron_like.parallel_state import ParallelState
from megatron_like.training import checkpointing
from megatron_like.training.checkpointing import latest_iteration, load_checkpoint, save_checkpoint

FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
         "--mock-data", "--vocab-size", "512", "--make-vocab-size-divisible-by", "8", "--ckpt-format", "torch"]


def build(save_root: str) -> tuple:
    config = parse_config(FLAGS + ["--save", save_root, "--load", save_root], world_size=1)
    ps = ParallelState.single_process(torch.device("cpu"))
    model = [GPTModel(config.model, ps, vocab_size=512, seed=1)]
    optimizer = torch.optim.AdamW(model[0].parameters(), lr=1e-3)
    return config, ps, model, optimizer


def fill(model: list[torch.nn.Module], value: float) -> None:
    with torch.no_grad():
        for p in model[0].parameters():
            p.fill_(value)


def assert_latest_loads(root: str, config, ps, model, optimizer) -> int:
    """Load the latest checkpoint; its weights must all equal the iteration number it was saved at."""
    iteration = latest_iteration(root)
    fill(model, -1.0)
    loaded, consumed = load_checkpoint(root, config, ps, model, optimizer, None)
    assert loaded == iteration and consumed == 10 * iteration
    for p in model[0].parameters():
        assert torch.all(p == float(iteration)), "loaded weights are not those of the tracked iteration"
    return iteration


class Crash(Exception):
    pass


def test_injected_fault_at_every_point_keeps_previous_checkpoint(tmp_path):
    root = str(tmp_path)
    config, ps, model, optimizer = build(root)
    fill(model, 1.0)
    save_checkpoint(root, 1, config, ps, model, optimizer, None, 10)
    points_seen: list[str] = []
    checkpointing.fault_hook = points_seen.append
    try:
        save_checkpoint(root, 2, config, ps, model, optimizer, None, 20)
    finally:
        checkpointing.fault_hook = None
    assert {"open", "written", "renamed", "tracker"} <= set(points_seen)
    fill(model, 2.0)
    save_checkpoint(root, 2, config, ps, model, optimizer, None, 20)
    for iteration in (3,):
        for crash_at in range(len(points_seen)):
            calls = iter(range(len(points_seen)))

            def hook(point: str, crash_at: int = crash_at, calls=calls) -> None:
                if next(calls) == crash_at:
                    raise Crash(point)

            fill(model, float(iteration))
            checkpointing.fault_hook = hook
            try:
                with pytest.raises(Crash):
                    save_checkpoint(root, iteration, config, ps, model, optimizer, None, 10 * iteration)
            finally:
                checkpointing.fault_hook = None
            last = assert_latest_loads(root, config, ps, model, optimizer)
            assert last in (iteration - 1, iteration)  # the final rename may have landed before the crash
        fill(model, float(iteration))
        save_checkpoint(root, iteration, config, ps, model, optimizer, None, 10 * iteration)
        assert assert_latest_loads(root, config, ps, model, optimizer) == iteration


def _save_forever(root: str, start: int, config, ps, model, optimizer) -> None:
    torch.set_num_threads(1)
    iteration = start
    while True:
        iteration += 1
        fill(model, float(iteration))
        save_checkpoint(root, iteration, config, ps, model, optimizer, None, 10 * iteration)


def _seconds_to_first_save(context, root: str, last: int, config, ps, model, optimizer) -> float:
    """How long a forked saver takes, measured now, from its start until the tracker names its first save."""
    child = context.Process(target=_save_forever, args=(root, last, config, ps, model, optimizer), daemon=True)
    start = time.perf_counter()
    child.start()
    while latest_iteration(root) == last and time.perf_counter() - start < 120:
        time.sleep(0.001)
    elapsed = time.perf_counter() - start
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    return elapsed


def test_sigkill_during_saves_keeps_latest_checkpoint_loadable(tmp_path):
    root = str(tmp_path)
    config, ps, model, optimizer = build(root)
    fill(model, 1.0)
    save_checkpoint(root, 1, config, ps, model, optimizer, None, 10)
    context = multiprocessing.get_context("fork")
    # Kill moments scale with how long a forked saver takes to finish its first save on this machine now (its
    # start-up included): a window sized by the save alone killed every child before its first save on a quiet
    # machine, and a fixed one did so on a loaded machine. Three such spans: most children save once or more,
    # and the kills land anywhere in start-up, writing, renaming and the tracker update.
    window = 3 * _seconds_to_first_save(context, root, 1, config, ps, model, optimizer)
    rng = random.Random(0)
    last, advanced = assert_latest_loads(root, config, ps, model, optimizer), 0
    for _ in range(25):
        child = context.Process(target=_save_forever, args=(root, last, config, ps, model, optimizer),
                                daemon=True)
        child.start()
        time.sleep(rng.uniform(0.0, window))
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        iteration = assert_latest_loads(root, config, ps, model, optimizer)
        assert iteration >= last
        advanced += iteration > last
        last = iteration
    assert advanced >= 5, "the saving process was always killed before its first save: the test proves little"


# ------------------------------------------------------------------ torch_dist: the trainer killed mid-save
# Two layers and one micro-batch per step: the steps are short, so most of a child's time is spent saving.
# A constant lr: the schedule must not depend on --train-iters, which differs between the runs compared.
DIST_FLAGS = ["--num-layers", "2", "--global-batch-size", "2", "--log-interval", "1000", "--ckpt-format", "torch_dist",
              "--lr-decay-style", "constant"]


def _train_and_save_every_step(root: str, async_save: bool, saving) -> None:
    from tests.distributed.gpt_runs import train_gpt

    torch.set_num_threads(1)
    checkpointing.fault_hook = lambda point: saving.set()  # common.pt and the tracker are written atomically
    train_gpt(0, 1, DIST_FLAGS + ["--save", root, "--load", root, "--save-interval", "1", "--train-iters", "100000"]
              + (["--async-save"] if async_save else []))


def _written_since(root: str, after_iteration: int, since: float) -> bool:
    """Whether a file of an iteration directory beyond ``after_iteration`` was written after ``since``."""
    for name in os.listdir(root):
        if name.startswith("iter_") and int(name[5:]) > after_iteration:
            directory = os.path.join(root, name)
            if any(os.path.getmtime(os.path.join(directory, f)) >= since for f in os.listdir(directory)):
                return True
    return False


def test_sigkill_during_sync_and_async_torch_dist_saves_keeps_latest_loadable(tmp_path):
    """20 trials, alternately synchronous and --async-save: a forked trainer resumes from the latest checkpoint
    and saves every step until SIGKILLed at a random moment after its first save began writing its plain files
    (so no kill is spent on start-up). Each trainer must load the checkpoint the tracker names and save again
    (else it dies or never saves); at the end training continues from the last one with the loss of the
    uninterrupted run at the next iteration, bitwise: every checkpoint of the chain held the exact state."""
    from tests.distributed.gpt_runs import train_gpt

    root = str(tmp_path)
    named: list[float] = []  # when each save of this first run named its checkpoint in the tracker
    checkpointing.fault_hook = lambda point: named.append(time.perf_counter()) if point == "tracker" else None
    try:
        train_gpt(0, 1, DIST_FLAGS + ["--save", root, "--save-interval", "1", "--train-iters", "4"])
    finally:
        checkpointing.fault_hook = None
    # One step plus one save, measured now on this machine: kills land anywhere in the steps and saves
    # (writes of the pieces, the index, common.pt, the tracker; the background writer) of the next 4.
    window = 4 * (named[-1] - named[1]) / (len(named) - 2)
    context = multiprocessing.get_context("fork")
    rng = random.Random(0)
    last, advanced, mid_save = 4, 0, 0
    for trial in range(20):
        saving = context.Event()
        child = context.Process(target=_train_and_save_every_step, args=(root, trial % 2 == 1, saving), daemon=True)
        started = time.time()
        child.start()
        while not saving.wait(timeout=0.05):
            assert child.is_alive(), f"trial {trial}: the trainer died before saving (exit code {child.exitcode}): " \
                                     f"the checkpoint of iteration {last} did not load"
        time.sleep(rng.uniform(0.0, window))
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        iteration = latest_iteration(root)
        assert iteration >= last
        advanced += iteration > last
        mid_save += _written_since(root, iteration, started)
        last = iteration
    assert advanced >= 5, "the trainer was always killed before it saved: the test proves little"
    assert mid_save >= 5, "few kills landed while a checkpoint was being written: the test proves little"
    continued = train_gpt(0, 1, DIST_FLAGS + ["--load", root, "--train-iters", str(last + 1)])["losses"]
    straight = train_gpt(0, 1, DIST_FLAGS + ["--train-iters", str(last + 1)])["losses"]
    assert continued == straight[last:], f"continued from iteration {last}: not the uninterrupted run"
