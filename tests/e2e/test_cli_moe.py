"""The MoE issue's "Done when" through the command line: a tiny mixture-of-experts model (Megatron-LM's
flags) trained on 4 ranks (as torchrun starts them: tests/e2e/cli.py's launch) at ep2 x tp2 with sequence
parallelism and the all-to-all dispatcher logs the lm loss and the router losses (load_balancing_loss, z_loss
lines) of one process; ``--help`` lists the flags.
"""

from __future__ import annotations

import pytest

from megatron_like.config import build_parser
from tests.e2e.cli import ISSUE_FLAGS, in_process_run, launch, logged_losses, logged_values

MOE_FLAGS = ISSUE_FLAGS + [
    "--train-iters", "3", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
    "--position-embedding-type", "rope", "--num-experts", "4", "--moe-router-topk", "2",
    "--moe-ffn-hidden-size", "32", "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3",
    "--moe-token-dispatcher-type", "alltoall", "--moe-shared-expert-intermediate-size", "32",
]
EP2_TP2_SP = ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel"]


def test_moe_ep2_tp2_logs_the_losses_and_router_losses_of_one_process():
    output = launch(4, MOE_FLAGS + EP2_TP2_SP)
    expected = in_process_run(MOE_FLAGS)
    losses = logged_losses(output)
    assert sorted(losses) == [1, 2, 3]
    assert [losses[i] for i in (1, 2, 3)] == pytest.approx(expected["losses"], rel=1e-4)
    for name in ("load_balancing_loss", "z_loss"):
        logged = logged_values(output, name)
        assert [logged.get(i) for i in (1, 2, 3)] == pytest.approx([s[name] for s in expected["moe_losses"]],
                                                                  rel=1e-4), name


def test_help_lists_the_moe_flags():
    text = build_parser().format_help()  # what pretrain_gpt.py --help prints
    for flag in ("--num-experts", "--moe-router-topk", "--moe-ffn-hidden-size", "--moe-layer-freq",
                 "--expert-model-parallel-size", "--expert-tensor-parallel-size",
                 "--moe-router-load-balancing-type", "--moe-aux-loss-coeff", "--moe-z-loss-coeff",
                 "--moe-token-dispatcher-type", "--moe-expert-capacity-factor", "--moe-pad-expert-input-to-capacity",
                 "--moe-grouped-gemm", "--moe-shared-expert-intermediate-size"):
        assert flag in text, flag
