"""The MoE issue's "Done when" through the command line: docs/moe.md's torchrun command (a tiny
mixture-of-experts model with Megatron-LM's flags at ep2 x tp2 with sequence parallelism and the all-to-all
dispatcher), run on 4 ranks as torchrun starts them (tests/e2e/cli.py's launch), logs the lm loss and the router
losses (load_balancing_loss, z_loss lines) of one process running the same flags without the layout; ``--help``
lists the flags.

The command is read from the page, so the numbers a user gets from the documented command are the ones proved
(a launch that differs from one process by design, e.g. with dropout on, is explained there).
"""

from __future__ import annotations

import pytest

from megatron_like.config import build_parser
from tests.e2e.cli import documented_launch, in_process_run, launch, logged_losses, logged_values

EP2_TP2_SP = ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel"]


def test_documented_moe_command_logs_the_losses_and_router_losses_of_one_process():
    nproc, flags = documented_launch("moe.md")
    assert nproc == 4 and flags[-len(EP2_TP2_SP):] == EP2_TP2_SP  # one process runs the flags before the layout
    output = launch(nproc, flags)
    assert output.count(" > padded vocab (size: 512) with 0 dummy tokens (new size: 512)\n") == 1  # rank 0's
    expected = in_process_run(flags[:-len(EP2_TP2_SP)])
    iterations = list(range(1, len(expected["losses"]) + 1))
    losses = logged_losses(output)
    assert sorted(losses) == iterations and len(iterations) >= 3
    assert [losses[i] for i in iterations] == pytest.approx(expected["losses"], rel=1e-5)
    for name in ("load_balancing_loss", "z_loss"):
        logged = logged_values(output, name)
        assert [logged.get(i) for i in iterations] == pytest.approx([s[name] for s in expected["moe_losses"]],
                                                                    rel=1e-5), name


def test_help_lists_the_moe_flags():
    """Every flag of docs/moe.md's flag table (DeepSeek routing's included) is one pretrain_gpt.py --help lists."""
    import re

    from tests.e2e.cli import ROOT

    text = build_parser().format_help()  # what pretrain_gpt.py --help prints
    page = (ROOT / "docs" / "moe.md").read_text()
    table = page.split("## Flags", 1)[1].split("\n\n", 2)[1]
    documented = set(re.findall(r"`(--[a-z][a-z-]*)", table))
    assert {"--num-experts", "--moe-router-score-function", "--moe-router-num-groups", "--moe-router-group-topk",
            "--moe-router-topk-scaling-factor", "--moe-router-enable-expert-bias",
            "--moe-router-bias-update-rate"} <= documented
    for flag in documented:
        assert re.search(rf"{flag}\b", text), flag
