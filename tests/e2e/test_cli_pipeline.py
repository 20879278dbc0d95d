"""The pipeline issue's CLI check: pretrain_gpt.py on 4 ranks and pipeline parallelism (1F1B with tp=2,
pp=4, interleaved) logs the lm loss of one process at every iteration; so do the V schedules (zb-v, dualpipev: two
chunks per rank, the loss logged by rank 0) on 2 ranks, and their bad flag combinations stop every rank with one
line before any work."""

from __future__ import annotations

import functools

import pytest

from megatron_like.config.parallel import V_SCHEDULES
from tests.distributed.harness import run_distributed
from tests.e2e.cli import _run_script_rank, in_process_losses, logged_losses

# The command of the "Done when", without the launcher and the layout flags; one evaluation batch (not
# the default 100) after training, as in cli.ISSUE_FLAGS.
PIPELINE_FLAGS = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
    "--max-position-embeddings", "32", "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "6",
    "--lr", "1e-3", "--mock-data", "--vocab-size", "512", "--hidden-dropout", "0", "--attention-dropout", "0",
    "--log-interval", "1", "--seed", "1234", "--eval-iters", "1",
]


@functools.cache
def single_process_losses() -> dict[int, float]:
    return in_process_losses(PIPELINE_FLAGS)


@pytest.mark.parametrize(
    "nproc,layout",
    [
        (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
        (4, ["--pipeline-model-parallel-size", "4"]),
        (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
             "--num-layers-per-virtual-pipeline-stage", "1"]),
        (2, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-v"]),
        (2, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "dualpipev"]),
    ],
    ids=["tp2-pp2", "pp4", "tp2-pp2-interleaved", "pp2-zb-v", "pp2-dualpipev"],
)
def test_cli_pipeline_logs_same_losses(nproc, layout):
    outputs = [out for _, out, _ in run_distributed(_run_script_rank, nproc, "pretrain_gpt.py", PIPELINE_FLAGS + layout,
                                                    True, True)]
    output = "".join(outputs)
    # The rank that logs: the last one of the ring's last stage, or on the V (the loss on stage 0) the last of stage 0.
    pp = int(layout[layout.index("--pipeline-model-parallel-size") + 1])
    v_shape = "--pipeline-schedule" in layout and layout[layout.index("--pipeline-schedule") + 1] in V_SCHEDULES
    reporting_rank = nproc // pp - 1 if v_shape else nproc - 1
    assert [rank for rank, out in enumerate(outputs) if logged_losses(out)] == [reporting_rank]
    expected = single_process_losses()
    assert sorted(expected) == list(range(1, 7))
    losses = logged_losses(output)
    assert sorted(losses) == sorted(expected)
    for iteration, loss in expected.items():
        assert losses[iteration] == pytest.approx(loss, rel=1e-4), f"iteration {iteration}"
    assert f"model parallel rank (0, {pp - 1})" in output, "every stage reports its parameters"
    assert "validation loss at the end of training for test data" in output


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--pipeline-schedule", "zb-v", "--num-layers-per-virtual-pipeline-stage", "1"],
         "error: --pipeline-schedule zb-v places two model chunks per rank in a V, which fixes the layers of each "
         "chunk: drop --num-layers-per-virtual-pipeline-stage"),
        (["--pipeline-schedule", "dualpipev", "--num-layers", "6"],
         "error: --pipeline-schedule dualpipev needs --num-layers 6 divisible by 2 * --pipeline-model-parallel-size 2 "
         "(two equal chunks per rank)"),
    ],
    ids=["zb-v-with-virtual-stages", "dualpipev-layers-not-divisible-by-2p"],
)
def test_cli_refuses_bad_v_schedule_flags_in_one_line(flags, message):
    """Every rank exits 2 (a usage error, as argparse's) before any process group or model, with no traceback;
    rank 0 prints the one-line error on stderr (once for the job)."""
    argv = PIPELINE_FLAGS + ["--pipeline-model-parallel-size", "2"] + flags
    results = run_distributed(_run_script_rank, 2, "pretrain_gpt.py", argv, True, False)
    for code, out, err in results:
        assert code == 2 and "Traceback" not in err and "iteration" not in out, err
    errors = [line for _, _, err in results for line in err.splitlines() if line.startswith("error: ")]
    assert errors == [message], results
