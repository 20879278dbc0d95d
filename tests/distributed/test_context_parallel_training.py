"""Context parallelism through pretrain() equals one process: the Llama-style model of test_llama_parallel
(rotary positions, GQA with 4 key/value heads for 8 query heads, SwiGLU, RMSNorm) trained at cp 2 with each
--cp-comm-type, with the sliding window, with selective recomputation, and cp combined with tensor + sequence
parallelism, interleaved pipeline parallelism, data parallelism with ZeRO-3, and (the MoE model of
test_moe_parallel) expert parallelism; cp 4 with the hierarchical a2a+p2p; the multi-latent attention model of
test_mla_parallel (query latent, YaRN) at cp 2 and at cp 2 x tp 2 with sequence parallelism. Each logs the
single-process losses and grad norms and holds its weights after training (the float32 tolerance of
``assert_same_training``); the single-process references are those test modules' (one run each, shared when the
suite runs them in one process).

Each cp rank holds two of the sequence's 2 x cp chunks (16 tokens: chunks of 4 at cp 2, of 2 at cp 4), so the
rotary positions, the causal mask across ranks, the whole sequence's loss and the dp x cp gradient average are all
on the line: a missing piece moves the first loss or the weights.
"""

from __future__ import annotations

import functools

import pytest
import torch

from megatron_like.parallel_state import ParallelState
from tests.distributed import test_llama_parallel as llama
from tests.distributed import test_mla_parallel as mla
from tests.distributed import test_moe_parallel as moe
from tests.distributed import test_mtp_parallel as mtp
from tests.distributed.gpt_runs import assert_same_training, merge_ranks, train_gpt, train_gpt_many
from tests.distributed.harness import run_distributed


def cp(size: int, comm_type: str = "p2p") -> list[str]:
    return ["--context-parallel-size", str(size), "--cp-comm-type", comm_type]


# DeepSeek routing with the expert bias and the sequence-level aux loss at cp 2: each cp rank routes half of every
# sequence, so the bias must follow the counts summed over dp x cp, and each sequence's aux-loss counts are summed
# over cp (test_moe_parallel's DeepSeek reference: one single-process run for both files).

# Attention dropout is a hash of one seed and the pair (sample, global head, positions), the seed drawn from the
# per-tp-rank stream: at cp 2 the same pairs drop as in one process whose window takes the same blockwise core.
ATTENTION_DROPOUT = ["--attention-dropout", "0.2"]


# Multi-latent attention (query latent, YaRN): its rope slice rotates at the global positions of each cp rank's
# chunks, and its keys (nope + rope) and narrower values cross the cp ranks.
MLA_Q_LATENT = mla.MLA + mla.Q_LATENT


@functools.cache
def window_dropout_reference() -> dict:
    return merge_ranks([train_gpt(0, 1, llama.LLAMA + llama.WINDOW + ATTENTION_DROPOUT)])


CASES: dict[int, dict[str, list[str]]] = {
    2: {
        "cp2-p2p": llama.LLAMA + cp(2),
        "cp2-all_gather": llama.LLAMA + cp(2, "all_gather"),
        "cp2-a2a": llama.LLAMA + cp(2, "a2a"),
        "window-cp2-p2p": llama.LLAMA + llama.WINDOW + cp(2),
        "window-dropout-cp2-a2a": llama.LLAMA + llama.WINDOW + ATTENTION_DROPOUT + cp(2, "a2a"),
        "cp2-all_gather-recompute-selective": llama.LLAMA + cp(2, "all_gather") + [
            "--recompute-granularity", "selective"],
        "moe-cp2-ep2-alltoall": moe.MOE + cp(2) + moe.ep(2) + moe.ALLTOALL,
        "mtp-cp2-p2p": mtp.MTP + cp(2),
        "deepseek-cp2-ep2-alltoall": moe.MOE + moe.DEEPSEEK + cp(2) + moe.ep(2) + moe.ALLTOALL,
        "mla-cp2-p2p": MLA_Q_LATENT + cp(2),
    },
    4: {
        "cp2-tp2-sp": llama.LLAMA + cp(2) + llama.TP2 + llama.SP,
        "cp2-pp2-vp2": llama.LLAMA + cp(2, "all_gather") + llama.PP2 + llama.VP,
        "mtp-cp2-a2a-pp2": mtp.MTP + cp(2, "a2a") + llama.PP2,
        "cp2-dp2-zero3": llama.LLAMA + cp(2) + llama.zero(3),
        "cp4-a2a+p2p": llama.LLAMA + cp(4, "a2a+p2p") + ["--hierarchical-context-parallel-sizes", "2", "2"],
        "moe-cp2-ep2-dp2-allgather-zero1": moe.MOE + cp(2) + moe.ep(2) + moe.ALLGATHER + moe.zero(1),
        "mla-cp2-tp2-sp-a2a": MLA_Q_LATENT + cp(2, "a2a") + mla.TP2 + mla.SP,
    },
}


@functools.cache
def runs(world_size: int) -> dict[str, dict]:
    names = list(CASES[world_size])
    per_rank = run_distributed(train_gpt_many, world_size, [CASES[world_size][n] for n in names], timeout=900)
    return {name: merge_ranks([rank_results[i] for rank_results in per_rank]) for i, name in enumerate(names)}


@pytest.mark.parametrize("world_size,name", [(w, n) for w, cases in CASES.items() for n in cases])
def test_context_parallel_training_equals_single_process(world_size: int, name: str) -> None:
    run = runs(world_size)[name]
    if name.startswith("deepseek"):
        expected = moe.reference(tuple(moe.DEEPSEEK))
        assert_same_training(expected, run)
        moe.assert_same_router_losses(expected, run)
        moe.assert_same_expert_biases(expected, run)
    elif name.startswith("mtp"):  # each depth's loss too: token t + k of a rank's chunk may lie on the other rank
        torch.testing.assert_close(mtp.mtp_losses(run), mtp.mtp_losses(mtp.reference()), rtol=1e-5, atol=0)
        assert_same_training(mtp.reference(), run)
    elif name.startswith("moe"):
        assert_same_training(moe.reference(), run)
        moe.assert_same_router_losses(moe.reference(), run)
    elif name.startswith("mla"):
        assert_same_training(mla.reference(), run)
    elif name.startswith("window-dropout"):
        assert_same_training(window_dropout_reference(), run)
    elif name.startswith("window"):
        assert_same_training(llama.reference("window"), run)
    else:
        assert_same_training(llama.reference(), run)


def test_rank_order_is_megatrons_tp_cp_dp_pp() -> None:
    """tp innermost, then cp, then dp, then pp (Megatron's order tp-cp-ep-dp-pp); at cp 1 the old layout."""
    states = [ParallelState(tp_size=2, cp_size=2, dp_size=2, pp_size=2, rank=r) for r in range(16)]
    coords = [(ps.tp_rank, ps.cp_rank, ps.dp_rank, ps.pp_rank) for ps in states]
    assert coords == [(t, c, d, p) for p in range(2) for d in range(2) for c in range(2) for t in range(2)]
    for ps in states:
        assert ps.rank_of(ps.tp_rank, ps.dp_rank, ps.pp_rank, ps.cp_rank) == ps.rank
        assert ps.dp_cp_rank == ps.dp_rank * 2 + ps.cp_rank  # ZeRO shards over dp x cp, cp innermost
    # cp 1 keeps every existing layout: rank = pp * (dp * tp) + dp * tp + tp
    for r in range(8):
        ps = ParallelState(tp_size=2, dp_size=2, pp_size=2, rank=r)
        assert (ps.tp_rank, ps.dp_rank, ps.pp_rank, ps.cp_rank) == (r % 2, r // 2 % 2, r // 4, 0)
    # the experts see the tp x cp x dp ranks of a stage: ep 2 over tp 1, cp 2 is the two cp ranks
    ps = ParallelState(tp_size=1, cp_size=2, dp_size=2, ep_size=2, rank=3)
    assert (ps.ep_rank, ps.expert_dp_rank, ps.expert_dp_size) == (1, 1, 2)
