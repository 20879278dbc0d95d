"""Global-tensor pieces of torch_dist checkpoints: flat ZeRO ranges as boxes, vocabulary trimming, and a
single-process save and resume (DCP without a process group; --load detects the format by itself)."""

from __future__ import annotations

import math
import os

import pytest
import torch

from megatron_like.model.sharded_state import clip_to, flat_range_boxes
from megatron_like.training.checkpointing import CheckpointError, write_tracker
from tests.distributed.gpt_runs import train_gpt


@pytest.mark.parametrize("shape", [(7,), (4, 10), (3, 4, 5), (1, 6), (6, 1)])
def test_flat_range_boxes_tile_every_range_in_flat_order(shape):
    n = math.prod(shape)
    for lo in range(n):
        for hi in range(lo + 1, n + 1):
            numbered = torch.arange(n).reshape(shape)
            start = lo
            for offsets, sizes in flat_range_boxes(shape, lo, hi):
                box = numbered[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
                # each box is the next contiguous flat range
                assert torch.equal(box.reshape(-1), torch.arange(start, start + math.prod(sizes))), (shape, lo, hi)
                start += math.prod(sizes)
            assert start == hi
            assert len(flat_range_boxes(shape, lo, hi)) <= 2 * len(shape) - 1


def test_clip_to_drops_rows_beyond_a_smaller_saved_vocabulary():
    local = torch.zeros(8, 3)
    pieces = clip_to([((4, 0), local[:4]), ((8, 0), local[4:])], (10, 3))
    assert [(o, tuple(t.shape)) for o, t in pieces] == [((4, 0), (4, 3)), ((8, 0), (2, 3))]
    assert pieces[1][1].data_ptr() == local[4].data_ptr()  # a view: loads land in place


def test_single_process_torch_dist_resume_is_exact_and_detected(tmp_path, monkeypatch):
    from megatron_like.training import dcp_reader

    flags = ["--hidden-dropout", "0.1", "--lr-decay-iters", "4", "--lr-warmup-iters", "1"]
    straight = train_gpt(0, 1, flags + ["--train-iters", "4"])
    train_gpt(0, 1, flags + ["--train-iters", "2", "--save", str(tmp_path), "--ckpt-format", "torch_dist"])
    assert (tmp_path / "iter_0000002" / ".metadata").exists()
    readers = []
    read_data = dcp_reader.DirectReader.read_data
    monkeypatch.setattr(dcp_reader.DirectReader, "read_data",
                        lambda self, *args: (readers.append(self), read_data(self, *args))[1])
    # Loaded with --ckpt-format torch (the format of this run's own saves): --load reads it from the directory.
    resumed = train_gpt(0, 1, flags + ["--train-iters", "4", "--load", str(tmp_path), "--ckpt-format", "torch"])
    assert resumed["losses"] == straight["losses"][2:]
    # Same layout: every tensor (weights, both moments) was read straight into its destination.
    assert [(r.direct > 0, r.fallback) for r in readers] == [(True, 0)]
    with pytest.raises(CheckpointError, match="--hidden-size 64 but this run has 32"):
        train_gpt(0, 1, flags + ["--train-iters", "4", "--load", str(tmp_path), "--hidden-size", "32"])


def test_direct_reads_take_whole_saved_pieces_and_leave_the_rest_to_dcp(tmp_path):
    """The torch_dist reader reads a saved piece straight into a contiguous destination of its dtype and
    shape (also a row range of a bigger one, as tp2 -> tp1 does); sub-ranges of a saved piece (another
    layout's split) and strided destinations go through DCP's reader. Every way loads the same values."""
    from megatron_like.model.sharded_state import GlobalPieces
    from megatron_like.training.dist_checkpointing import _dcp_load, _dcp_save

    a, b = torch.randn(6, 4), torch.randn(5).bfloat16()
    _dcp_save({"a": GlobalPieces((6, 4), [((0, 0), a[:3].clone()), ((3, 0), a[3:].clone())]),
               "b": GlobalPieces((5,), [((0,), b)]), "plain": {"x": 1}}, str(tmp_path))

    def load(pieces_of_a, into_a: torch.Tensor) -> tuple[int, int]:
        into_b = torch.zeros(5, dtype=torch.bfloat16)
        state = {"a": GlobalPieces((6, 4), pieces_of_a(into_a)), "b": GlobalPieces((5,), [((0,), into_b)]),
                 "plain": None}
        reader = _dcp_load(state, str(tmp_path))
        assert torch.equal(into_a, a) and torch.equal(into_b, b) and state["plain"] == {"x": 1}
        into_b.untyped_storage().resize_(0)  # still resizable: ZeRO-3 frees gathered parameters this way
        return reader.direct, reader.fallback

    assert load(lambda t: [((0, 0), t[:3]), ((3, 0), t[3:])], torch.zeros(6, 4)) == (3, 0)  # the saved layout
    assert load(lambda t: [((0, 0), t)], torch.zeros(6, 4)) == (3, 0)  # both saved pieces land in one
    # Split at row 2: saved rows 0-2 go in two sub-ranges, saved rows 3-5 whole into the second piece.
    assert load(lambda t: [((0, 0), t[:2]), ((2, 0), t[2:])], torch.zeros(6, 4)) == (2, 2)
    assert load(lambda t: [((0, 0), t[:, :2]), ((0, 2), t[:, 2:])], torch.zeros(6, 4)) == (1, 4)  # columns
    assert load(lambda t: [((0, 0), t)], torch.zeros(4, 6).t()) == (1, 2)  # a strided destination


def test_precision_change_takes_masters_from_the_right_keys(tmp_path):
    """bf16 checkpoint -> fp32 run: the params are the saved fp32 masters, not the bf16 weights. fp32 checkpoint
    -> bf16 run: the masters come from the fp32 weights (a second read, since the params read the same keys)
    and training continues close to the fp32 run."""
    from megatron_like.training.dist_checkpointing import read_full_tensors

    flags = ["--lr-decay-iters", "4", "--lr-warmup-iters", "1", "--ckpt-format", "torch_dist"]
    bf16, fp32 = tmp_path / "bf16", tmp_path / "fp32"
    train_gpt(0, 1, flags + ["--train-iters", "2", "--bf16", "--save", str(bf16)])
    loaded = train_gpt(0, 1, flags + ["--train-iters", "2", "--load", str(bf16)])["params"]  # no further step
    masters = read_full_tensors(str(bf16), ["optimizer.master." + name for name in loaded])
    for name, tensor in loaded.items():
        assert torch.equal(tensor, masters["optimizer.master." + name]), name
    assert any(not torch.equal(t, t.bfloat16().float()) for t in loaded.values())  # masters hold more than bf16

    straight = train_gpt(0, 1, flags + ["--train-iters", "4", "--save", str(fp32), "--save-interval", "2"])
    write_tracker(str(fp32), 2)
    resumed = train_gpt(0, 1, flags + ["--train-iters", "4", "--bf16", "--load", str(fp32)])
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(straight["losses"][2:]),
                               rtol=0, atol=2e-2)


def test_async_save_of_the_torch_format_is_refused():
    from megatron_like.config import ConfigError, parse_config
    from tests.distributed.gpt_runs import BASE_FLAGS

    assert parse_config(BASE_FLAGS, world_size=1).checkpoint.ckpt_format == "torch_dist"  # Megatron's default
    with pytest.raises(ConfigError, match="--async-save writes torch_dist checkpoints only; drop --ckpt-format torch"):
        parse_config(BASE_FLAGS + ["--async-save", "--ckpt-format", "torch"], world_size=1)


def test_inference_loaders_read_torch_dist_like_the_torch_format(tmp_path):
    """load_full_state / read_saved_config (generation, the server, evaluation, HF export, classification) read a
    torch_dist checkpoint as the same full weights as a torch one of the same run."""
    from megatron_like.inference.loading import load_inference_model
    from megatron_like.model.state import load_full_state, read_saved_config
    from megatron_like.parallel_state import ParallelState

    flags = ["--train-iters", "2", "--untie-embeddings-and-output-weights"]
    train_gpt(0, 1, flags + ["--save", str(tmp_path / "torch"), "--ckpt-format", "torch"])
    train_gpt(0, 1, flags + ["--save", str(tmp_path / "dist"), "--ckpt-format", "torch_dist"])
    assert read_saved_config(str(tmp_path / "dist")).model == read_saved_config(str(tmp_path / "torch")).model
    _, expected = load_full_state(str(tmp_path / "torch"))
    _, full = load_full_state(str(tmp_path / "dist"))
    assert set(full) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(full[name], tensor), name
    _, stage = load_full_state(str(tmp_path / "dist"), layers=[1])
    assert not any(k.startswith(("layers.0.", "layers.2.")) for k in stage) and "layers.1.mlp.fc1.weight" in stage
    ps = ParallelState.single_process(torch.device("cpu"))
    tokens = torch.arange(32).reshape(2, 16) % 256
    positions = torch.arange(16)[None].expand_as(tokens)
    with torch.no_grad():
        logits = [load_inference_model(str(tmp_path / name), ps, with_tokenizer=False).model[0](tokens, positions)
                  for name in ("torch", "dist")]
    assert torch.equal(logits[0], logits[1])


def test_reshard_tool_command_line_converts_torch_through_torch_dist_and_refuses_needless_work(tmp_path, capsys,
                                                                                              monkeypatch):
    """tools/checkpoint_reshard.py on the command line: a one-process torch checkpoint becomes a torch one of
    tp 2 in two torchrun passes (torch -> torch_dist at tp 1, torch_dist -> torch at tp 2; the temporary copy
    is removed); torch_dist -> torch_dist is refused. (Resuming from its results: test_checkpoint_reshard.py.)

    The tool's torchrun commands are parsed by torchrun's parser and their ranks forked from the harness's
    server (cli.forked_torchrun_command): two real torchruns started five fresh interpreters."""
    import sys
    import types

    from tests.e2e.cli import ROOT, forked_torchrun_command

    train_gpt(0, 1, ["--train-iters", "1", "--save", str(tmp_path / "torch"), "--ckpt-format", "torch"])
    train_gpt(0, 1, ["--train-iters", "1", "--save", str(tmp_path / "dist")])
    sys.path.insert(0, str(ROOT / "tools"))
    import checkpoint_reshard

    monkeypatch.setattr(checkpoint_reshard, "subprocess", types.SimpleNamespace(run=forked_torchrun_command))
    out = tmp_path / "tp2"
    assert checkpoint_reshard.main(["--load", str(tmp_path / "torch"), "--save", str(out), "--ckpt-format", "torch",
                                    "--target-tensor-model-parallel-size", "2"]) == 0
    assert sorted(os.listdir(out)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]  # no torch_dist_tmp
    assert sorted(os.listdir(out / "iter_0000001")) == ["mp_rank_00_000", "mp_rank_01_000"]
    assert checkpoint_reshard.main(["--load", str(tmp_path / "dist"), "--save", str(tmp_path / "again"),
                                    "--ckpt-format", "torch_dist"]) == 2
    assert "torch_dist checkpoint, which loads at any layout" in capsys.readouterr().err
