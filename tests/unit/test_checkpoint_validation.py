"""``validate_checkpoint`` refuses every broken checkpoint with one line naming the file and the problem
and every rank refuses when one rank's file is broken (two processes)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from megatron_like.config import parse_config
from megatron_like.model import GPTModel
from megatron_like.parallel_state import ParallelState
from megatron_like.training.checkpoint_validation import validate_checkpoint
from megatron_like.training.checkpointing import CheckpointError, save_checkpoint

FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
         "--mock-data", "--vocab-size", "64", "--make-vocab-size-divisible-by", "8", "--ckpt-format", "torch"]


class Payload:
    """Pickles as a call of os.getpid: harmless, but no weights-only loader may build it."""

    def __reduce__(self):
        return (os.getpid, ())


def build(root: str, *extra: str):
    config = parse_config(FLAGS + ["--save", root, "--load", root, *extra], world_size=1)
    ps = ParallelState.single_process(torch.device("cpu"))
    model = [GPTModel(config.model, ps, vocab_size=config.padded_vocab_size(config.model.vocab_size), seed=1)]
    return config, ps, model, torch.optim.AdamW(model[0].parameters(), lr=1e-3)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("valid"))
    config, ps, model, optimizer = build(root)
    save_checkpoint(root, 5, config, ps, model, optimizer, None, 50)
    return root


def broken_copy(saved: str, tmp_path) -> tuple[str, str]:
    root = str(tmp_path / "ckpt")
    shutil.copytree(saved, root)
    return root, os.path.join(root, "iter_0000005", "mp_rank_00_000", "model_optim_rng.pt")


def refusal(root: str, *extra: str) -> str:
    config, ps, model, optimizer = build(root, *extra)
    with pytest.raises(CheckpointError) as caught:
        validate_checkpoint(root, config, ps, model, optimizer)
    message = str(caught.value)
    assert "\n" not in message and "weights_only" not in message, message
    return message


def test_a_good_checkpoint_passes(saved):
    config, ps, model, optimizer = build(saved)
    validate_checkpoint(saved, config, ps, model, optimizer)


def test_broken_files_are_refused_naming_the_file(saved, tmp_path):
    root, path = broken_copy(saved, tmp_path)
    data = Path(path).read_bytes()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    assert refusal(root).startswith(f"checkpoint file {path} is truncated or not a torch checkpoint")

    with open(path, "wb") as f:
        f.write(os.urandom(4096))
    assert f"checkpoint file {path} is truncated or not a torch checkpoint" in refusal(root)

    torch.save({"iteration": 5, "config": {}, "model": [], "payload": Payload()}, path)
    message = refusal(root)
    assert message.startswith(f"checkpoint file {path} is refused: its pickle holds a reference to ") and \
        "getpid" in message, message

    os.remove(path)
    assert f"checkpoint file {path} is missing" in refusal(root)


def test_tracker_and_layout_problems_are_refused(saved, tmp_path):
    root, _ = broken_copy(saved, tmp_path)
    tracker = os.path.join(root, "latest_checkpointed_iteration.txt")
    with open(tracker, "w") as f:
        f.write("7\n")
    assert "names iteration 7 but" in refusal(root) and "iter_0000007" in refusal(root)
    with open(tracker, "w") as f:
        f.write("garbage\n")
    assert "not an iteration number" in refusal(root)
    with open(tracker, "w") as f:
        f.write("5\n")
    assert "--hidden-size 32 but this run has 64" in refusal(root, "--hidden-size", "64")
    assert "--num-layers 2 but this run has 4" in refusal(root, "--num-layers", "4")
    assert "--untie-embeddings-and-output-weights" in refusal(root, "--untie-embeddings-and-output-weights")
    # Not a flag check_compatible compares: the tensors themselves must fit.
    assert "embedding.word_embeddings.weight has shape (64, 32), this model has (128, 32)" in \
        refusal(root, "--vocab-size", "128")
    # A torch_dist save interrupted before DCP wrote its index (the tracker never names one: a hand-edited
    # tracker or a crash in a save that rewrote the named directory).
    os.makedirs(os.path.join(root, "iter_0000009"))
    open(os.path.join(root, "iter_0000009", "__0_0.distcp"), "wb").close()
    with open(tracker, "w") as f:
        f.write("9\n")
    assert "iter_0000009 holds torch_dist pieces but no .metadata index (an interrupted save)" in refusal(root)


def agreement_worker(rank: int, world_size: int, root: str) -> str:
    torch.set_num_threads(1)
    config = parse_config(FLAGS + ["--load", root], world_size=world_size)
    ps = ParallelState.initialize(config.parallel, world_size)
    model = [GPTModel(config.model, ps, vocab_size=64, seed=1)]
    try:
        validate_checkpoint(root, config, ps, model, torch.optim.AdamW(model[0].parameters(), lr=1e-3))
    except CheckpointError as error:
        return str(error)
    return "accepted"


def test_a_file_broken_on_one_rank_is_refused_by_every_rank(saved, tmp_path):
    """Two data-parallel ranks: only rank 1 reads optim_rng_dp_001.pt; it is truncated, both refuse."""
    from tests.distributed.harness import run_distributed

    root, path = broken_copy(saved, tmp_path)
    own = os.path.join(os.path.dirname(path), "optim_rng_dp_001.pt")
    data = Path(path).read_bytes()
    with open(own, "wb") as f:
        f.write(data[: len(data) // 3])
    messages = run_distributed(agreement_worker, 2, root, timeout=120)
    assert messages[0] == messages[1] and messages[0].startswith(f"checkpoint file {own} is truncated"), messages
