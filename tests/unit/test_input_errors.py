"""Careless input to ``pretrain_gpt.main``, in this process: bad flags and paths stop before any process
group starts with one line printed once (rank 0; other ranks print nothing), flags with no effect in the
layout warn in one line, and a broken checkpoint or a busy ``--save`` exits 1 with one line."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch.distributed as dist

import pretrain_gpt
from megatron_like.config import parse_config_or_exit
from megatron_like.parallel_state import ParallelState
from megatron_like.training.checkpointing import CheckpointError
from megatron_like.training.job_lock import (
    LOCK_FILE,
    CheckpointDirectoryBusyError,
    _start_time,
    hold_checkpoint_directory,
    take_lock,
)

FLAGS = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
         "--micro-batch-size", "1", "--train-iters", "2", "--mock-data", "--vocab-size", "128", "--eval-iters", "0",
         "--make-vocab-size-divisible-by", "8", "--num-workers", "0"]


def stderr_of_main(argv: list[str], capsys, monkeypatch, rank: str = "0") -> tuple[int, str]:
    monkeypatch.setenv("RANK", rank)
    with pytest.raises(SystemExit) as stopped:
        pretrain_gpt.main(argv)
    assert not dist.is_initialized()  # stopped before any process group
    return stopped.value.code, capsys.readouterr().err


def test_bad_flags_and_paths_stop_before_any_process_group_in_one_line_printed_once(tmp_path, capsys, monkeypatch):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    (tmp_path / "only.bin").write_text("")
    tracker = tmp_path / "bad" / "latest_checkpointed_iteration.txt"
    tracker.parent.mkdir()
    tracker.write_text("12\n")
    cases = {
        "--bogus-flag": "unrecognized arguments: --bogus-flag (see ",
        "--hidden-size abc": "argument --hidden-size: invalid int value: 'abc' (see ",
        "--train-iters 0": "--train-iters 0 trains nothing",
        f"--load {tmp_path / 'typo'}": f"--load {tmp_path / 'typo'} does not exist",
        f"--load {tmp_path}": f"--load {tmp_path} holds no latest_checkpointed_iteration.txt",
        f"--load {tracker.parent}": f"{tracker} names iteration 12 but {tracker.parent / 'iter_0000012'} does not",
        f"--save {not_a_dir / 'sub'}": f"--save {not_a_dir / 'sub'} cannot be created",
        f"--data-path 0.5 {tmp_path / 'only'} 0.5 {tmp_path / 'none'}": f"{tmp_path / 'only'}.idx not found",
        f"--data-path {tmp_path / 'none'}": f"{tmp_path / 'none'}.bin and {tmp_path / 'none'}.idx not found",
        "--reset-attention-mask": "--reset-attention-mask needs end-of-document tokens and --mock-data has none",
    }
    for extra, expected in cases.items():
        argv = FLAGS + extra.split()
        if extra.startswith("--data-path"):
            argv.remove("--mock-data")
        code, err = stderr_of_main(argv, capsys, monkeypatch)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], (extra, err)
        assert "usage:" not in err
        code, err = stderr_of_main(argv, capsys, monkeypatch, rank="1")
        assert code == 2 and err == "", (extra, err)  # printed once for the whole launch


# Issue 25's command lines taken on trust, each with the start of its one line. {tmp}: the test's directory, where
# "file" is a regular file and "vocab.bpe" a merges file.
ISSUE_CASES = {
    "--moe-router-topk 1": "--moe-router-topk 1 needs --num-experts",
    "--moe-aux-loss-coeff 0.01": "--moe-aux-loss-coeff 0.01 needs --num-experts",
    "--moe-grouped-gemm": "--moe-grouped-gemm needs --num-experts",
    "--global-batch-size 0": "--global-batch-size 0 must be positive",
    "--global-batch-size -4": "--global-batch-size -4 must be positive",
    "--ffn-hidden-size 0": "--ffn-hidden-size 0 must be positive",
    "--make-vocab-size-divisible-by -8": "--make-vocab-size-divisible-by -8 must be positive",
    "--lr inf": "--lr inf must be at least 0",
    "--lr-decay-iters -5": "--lr-decay-iters -5 must be positive",
    "--exit-interval -1": "--exit-interval -1 must be positive",
    "--exit-interval 0": "--exit-interval 0 must be positive",
    "--exit-duration-in-mins -1": "--exit-duration-in-mins -1.0 must be positive",
    "--weight-decay -0.1": "--weight-decay -0.1 must be at least 0",
    "--weight-decay nan": "--weight-decay nan must be at least 0",
    "--adam-eps -1e-8": "--adam-eps -1e-08 must be positive",
    "--adam-eps nan": "--adam-eps nan must be positive",
    "--seed -1": "--seed -1 must be in [0, 4294967295]",
    f"--seed {2**70}": f"--seed {2**70} must be in [0, 4294967295]",
    "--vocab-file {tmp}/missing.json --merge-file {tmp}/vocab.bpe": "--vocab-file {tmp}/missing.json is not a file",
    "--vocab-file {tmp}/file --merge-file {tmp}/missing.bpe": "--merge-file {tmp}/missing.bpe is not a file",
    "--tensorboard-dir {tmp}/file/tb": "--tensorboard-dir {tmp}/file/tb cannot be created",
    "--data-path {tmp}/docs --data-cache-path {tmp}/file/cache": "--data-cache-path {tmp}/file/cache cannot be created",
    "--load {tmp}/file": "--load {tmp}/file is a file; pass the checkpoint directory",
}


@pytest.mark.parametrize("flags", list(ISSUE_CASES))
def test_issue_command_lines_are_one_line_before_any_process_group(flags, tmp_path, capsys, monkeypatch):
    """Through pretrain_gpt.main: one line on rank 0, nothing on another rank, status 2, no process group."""
    (tmp_path / "file").write_text("x")
    (tmp_path / "vocab.bpe").write_text("#version: 0.2\n")
    for ext in (".bin", ".idx"):  # the data prefix exists: the cache directory is the problem
        (tmp_path / ("docs" + ext)).write_text("")
    argv = FLAGS + flags.format(tmp=tmp_path).split()
    if "--data-path" in argv:
        argv.remove("--mock-data")
    expected = ISSUE_CASES[flags].format(tmp=tmp_path)
    code, err = stderr_of_main(argv, capsys, monkeypatch)
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"error: {expected}"), (flags, err)
    code, err = stderr_of_main(argv, capsys, monkeypatch, rank="1")
    assert code == 2 and err == "", (flags, err)


def test_flags_with_no_effect_warn_in_one_line(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    parse_config_or_exit(FLAGS + ["--sequence-parallel", "--overlap-grad-reduce", "--save-interval", "5"])
    assert capsys.readouterr().err.splitlines() == [
        "warning: --sequence-parallel has no effect with --tensor-model-parallel-size 1",
        "warning: --overlap-grad-reduce has no effect with one data-parallel rank (no gradient reduction)",
        "warning: --save-interval has no effect without --save",
    ]
    parse_config_or_exit([f for f in FLAGS if f != "--mock-data"] + ["--data-path", "corpus", "--reset-position-ids",
                                                                      "--position-embedding-type", "rope"])
    assert capsys.readouterr().err.splitlines() == [
        "warning: --reset-position-ids has no effect with --position-embedding-type rope (only learned absolute "
        "positions read the position ids)"]


def test_load_equal_to_save_starts_fresh_with_a_notice(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    save = str(tmp_path / "new")
    pretrain_gpt.main(FLAGS + ["--save", save, "--load", save])
    out = capsys.readouterr().out
    assert f" > WARNING: --load {save} holds no checkpoint; starting from scratch" in out
    assert os.path.exists(os.path.join(save, "iter_0000002"))

    shard = os.path.join(save, "iter_0000002", "common.pt")  # torch_dist (the default format)
    with open(shard, "wb") as f:
        f.write(b"garbage")
    with pytest.raises(SystemExit) as stopped:
        pretrain_gpt.main(FLAGS + ["--save", save, "--load", save, "--train-iters", "4"])
    captured = capsys.readouterr()
    assert stopped.value.code == 1 and " iteration " not in captured.out
    assert captured.err.splitlines() == [f"error: checkpoint file {shard} is truncated or not a torch checkpoint "
                                         "(File is not a zip file); write an earlier saved iteration into "
                                         "latest_checkpointed_iteration.txt"]


def test_one_job_per_save_directory(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    save = str(tmp_path)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        holder = {"host": socket.gethostname(), "pid": other.pid, "start": _start_time(other.pid), "since": "then"}
        with open(os.path.join(save, LOCK_FILE), "w") as f:
            json.dump(holder, f)
        with pytest.raises(SystemExit) as stopped:
            pretrain_gpt.main(FLAGS + ["--save", save])
        assert stopped.value.code == 1
        assert capsys.readouterr().err.splitlines() == [
            f"error: --save {save} is in use by another job (pid {other.pid} on {socket.gethostname()}, since then); "
            "stop it or pass another --save"]
    finally:
        other.kill()
        other.wait()
    leftover = tmp_path / "iter_0000001" / "mp_rank_00_000" / "model_optim_rng.pt.megatron_like-tmp.4242"
    leftover.parent.mkdir(parents=True)
    leftover.write_bytes(b"half a save")
    ps = ParallelState.single_process()
    lock = hold_checkpoint_directory(save, ps)  # the holder is dead now: a stale lock
    out = capsys.readouterr().out
    assert f" > taking over the lock of --save {save} from pid {other.pid} on " in out
    assert " > removed 1 temporary file(s) of interrupted saves" in out and not leftover.exists()
    with open(os.path.join(save, LOCK_FILE)) as f:
        assert json.load(f)["pid"] == os.getpid()
    lock.release()
    assert not os.path.exists(os.path.join(save, LOCK_FILE))

    with open(os.path.join(save, LOCK_FILE), "w") as f:
        json.dump({**holder, "host": "elsewhere", "pid": 1}, f)
    with pytest.raises(CheckpointDirectoryBusyError, match=r"locked by pid 1 on host elsewhere .* delete "):
        take_lock(save)
    assert issubclass(CheckpointDirectoryBusyError, CheckpointError)
