"""A request whose preparation fails on one rank only (tp=2) is agreed by both ranks before anyone answers:
both get the same 500 and its message, and the next request runs normally on both (the ranks stayed in
step). So does a request every rank refuses (400) and one that fails inside generation on every rank."""

from __future__ import annotations

import torch

from megatron_like.config import ParallelConfig
from megatron_like.inference import load_inference_model, serving
from megatron_like.parallel_state import ParallelState
from tests.distributed.harness import run_distributed
from tests.e2e.test_server_fuzz import tiny_checkpoint

GREEDY = {"max_new_tokens": 3}
REQUESTS = [
    {"ids": [[5, 9, 13]], "params": GREEDY},
    {"ids": [[5, 9, 13]], "params": GREEDY, "fail_on_rank": 1},  # a fault of rank 1 alone
    {"ids": [[5, 9, 13]], "params": {"max_new_tokens": 3, "temperature": -1.0}},  # refused by every rank
    {"ids": [[5, 9, 13]], "params": {"max_new_tokens": 2}},  # fails inside generation on every rank
    {"ids": [[5, 9, 13]], "params": GREEDY},
]


def worker(rank: int, world_size: int, checkpoint: str) -> list[tuple[int, object]]:
    torch.set_num_threads(1)
    ps = ParallelState.initialize(ParallelConfig(tensor_model_parallel_size=2))
    loaded = load_inference_model(checkpoint, ps)
    real_prepare, real_generate = serving.prepare_request, serving.generate

    def prepare_request(loaded, request):
        if request.get("fail_on_rank") == rank:
            raise RuntimeError(f"injected fault on rank {rank}")
        return real_prepare(loaded, request)

    def generate(model, ids, params, **kwargs):
        if params.max_new_tokens == 2:
            raise RuntimeError("injected fault in generation")
        return real_generate(model, ids, params, **kwargs)

    serving.prepare_request, serving.generate = prepare_request, generate  # this process only
    outcomes = []
    for request in REQUESTS:
        received = serving.broadcast_request(request if rank == 0 else None, ps.device)
        outcome = serving.serve_request(loaded, received, ps.device)
        tokens = [g[0].token_ids for g in outcome.results] if outcome.results else None
        outcomes.append((outcome.status, outcome.message, tokens))
    return outcomes


def test_a_fault_on_one_rank_is_answered_by_all_and_the_next_request_runs(tmp_path):
    checkpoint = tiny_checkpoint(str(tmp_path))
    rank0, rank1 = run_distributed(worker, 2, checkpoint, timeout=120)
    assert rank0 == rank1  # same statuses, messages and tokens on both ranks
    (ok_status, _, tokens), (fault_status, fault, _), (bad_status, bad, _), (gen_status, gen, _), \
        (again_status, _, again) = rank0
    assert ok_status == 200 and again_status == 200 and again == tokens and len(tokens[0]) == 3
    assert fault_status == 500 and "injected fault on rank 1" in fault
    assert bad_status == 400 and "temperature" in bad
    assert gen_status == 500 and "injected fault in generation" in gen
