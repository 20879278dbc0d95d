"""Context parallelism's layout in one process: the load-balanced chunks and their positions, the whole sequence's
loss when a cp rank's tokens are all masked, and the layouts that cannot work stopping before any process group
with one line."""

from __future__ import annotations

import pytest
import torch

from megatron_like.model.context_parallel import cp_positions, sequence_mean_loss, split_batch
from megatron_like.parallel_state import ParallelState
from tests.unit.test_input_errors import FLAGS, stderr_of_main


def test_rank_r_keeps_chunks_r_and_2cp_minus_1_minus_r() -> None:
    assert cp_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert cp_positions(16, 4, 1).tolist() == [2, 3, 12, 13]
    # tokens, labels, loss mask and positions are cut alike, and the ranks' pieces are the sequence once
    text = torch.arange(2 * 16).view(2, 16)
    batch = {"tokens": text, "labels": text + 100, "loss_mask": text.float(), "position_ids": text % 16}
    pieces = [split_batch(batch, ParallelState(cp_size=4, rank=r)) for r in range(4)]
    for r, piece in enumerate(pieces):
        assert piece["tokens"].shape == (2, 4)
        assert torch.equal(piece["position_ids"][0], cp_positions(16, 4, r))
        assert torch.equal(piece["labels"], piece["tokens"] + 100)
    order = torch.cat([cp_positions(16, 4, r) for r in range(4)]).argsort()
    assert torch.equal(torch.cat([p["tokens"] for p in pieces], dim=1)[:, order], text)


def test_a_cp_rank_with_every_token_masked_gives_a_finite_loss_and_no_gradient() -> None:
    per_token = torch.rand(2, 4, requires_grad=True)
    loss, reported = sequence_mean_loss(per_token, torch.zeros(2, 4), ParallelState(cp_size=2, rank=0))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(reported) and per_token.grad.abs().max() == 0


@pytest.mark.parametrize("extra,expected", [
    ("--context-parallel-size 3", "world size 4 is not divisible by --tensor-model-parallel-size 1 * "
                                  "--context-parallel-size 3"),
    ("--context-parallel-size 4 --seq-length 12", "--seq-length 12 is not divisible by 2 * --context-parallel-size 4"),
    ("--context-parallel-size 4 --cp-comm-type a2a", "heads of each tensor-parallel rank are not divisible by the "
                                                     "all-to-all size 4"),
    ("--context-parallel-size 4 --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 3 2",
     "their product must be --context-parallel-size 4"),
    ("--context-parallel-size 4 --hierarchical-context-parallel-sizes 2 2", "needs --cp-comm-type a2a+p2p"),
    ("--context-parallel-size 2 --ckpt-format torch --save ckpt", "--ckpt-format torch cannot save "
                                                                  "--context-parallel-size 2"),
])
def test_a_layout_that_cannot_work_stops_in_one_line(extra: str, expected: str, capsys, monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    code, err = stderr_of_main(FLAGS + extra.split(), capsys, monkeypatch)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and expected in lines[0], err


def test_entry_points_without_context_parallelism_refuse_it_in_one_line() -> None:
    """ViT training, classifier fine-tuning and the inference tools (generation, serving, evaluation) say so
    instead of running the layout wrongly."""
    import finetune_gpt_classification
    import pretrain_vit
    from megatron_like.config import ConfigError, parse_config
    from megatron_like.inference.cli import setup

    cp2 = ["--context-parallel-size", "2"]
    vit = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--micro-batch-size", "1",
           "--train-iters", "1", "--mock-data"]
    with pytest.raises(ConfigError, match="pretrain_vit.py runs without it"):
        pretrain_vit.build_config(vit + cp2)
    with pytest.raises(ConfigError, match="fine-tune without context parallelism"):
        finetune_gpt_classification.build_config(FLAGS + cp2 + ["--train-data", "train.tsv"])
    with pytest.raises(ConfigError, match="run without context parallelism"):
        setup(parse_config(FLAGS + cp2, world_size=2))
