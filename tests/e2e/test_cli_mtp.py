"""Multi-token prediction through the command line: ``pretrain_gpt.py`` with ``--mtp-num-layers 2`` at pp2 (two ranks
as torchrun starts them) prints, on every training log line after the ``lm loss``, ``mtp_1 loss`` and ``mtp_2 loss``
entries equal to one process's; the validation line shows them too; ``--help`` lists the flags."""

from __future__ import annotations

import re

import pytest

from megatron_like.config import build_parser
from tests.e2e.cli import ISSUE_FLAGS, in_process_run, launch, logged_losses, logged_values

MTP = ["--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.3", "--train-iters", "3"]
PP2 = ["--pipeline-model-parallel-size", "2"]


def test_pp2_logs_each_mtp_loss_of_one_process():
    output = launch(2, ISSUE_FLAGS + MTP + PP2)
    expected = in_process_run(ISSUE_FLAGS + MTP)
    iterations = list(range(1, len(expected["losses"]) + 1))
    assert re.search(r"\| lm loss: \S+ \| mtp_1 loss: \S+ \| mtp_2 loss: \S+ \| loss scale", output)
    losses = logged_losses(output)
    assert [losses[i] for i in iterations] == pytest.approx(expected["losses"], rel=1e-5)
    for name in ("mtp_1 loss", "mtp_2 loss"):
        logged = logged_values(output, name)
        assert [logged.get(i) for i in iterations] == pytest.approx([s[name] for s in expected["loss_stats"]],
                                                                    rel=1e-5), name
    assert re.search(r"validation loss at .*\| mtp_1 loss value: \S+ \|", output)


def test_help_lists_the_mtp_flags():
    text = build_parser().format_help()
    assert "--mtp-num-layers" in text and "--mtp-loss-scaling-factor" in text
