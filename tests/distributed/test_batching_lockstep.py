"""Continuous batching on 2 ranks at tp=2, pp=2 and ep=2 (an MoE model) (``scheduler.py`` on rank 0,
``run_follower_loop`` on the other): sequences that join a running one get the single-process greedy tokens, an
echoed prompt's log-probabilities equal a one-process full forward's (the pipeline's last stage computes them), and
a fault of rank 1 alone in a step's checks is agreed by both ranks: every sequence then in flight ends with the
same 500, and the next request runs normally (the ranks stayed in step); a request whose client left frees its
slot on both ranks (the sequence that moves into it and the next request run on both in step)."""

from __future__ import annotations

import itertools

import pytest
import torch

from megatron_like.config import ParallelConfig
from megatron_like.inference import GenerationParams, generate, load_inference_model
from megatron_like.inference.batching import BatchEngine
from megatron_like.inference.scheduler import Job, Sampling, Scheduler, run_follower_loop
from megatron_like.parallel_state import ParallelState
from tests.distributed.harness import run_distributed
from tests.e2e.test_server_fuzz import tiny_checkpoint


def worker(rank: int, world_size: int, checkpoint: str, tp: int, pp: int, ep: int) -> dict | None:
    torch.set_num_threads(1)
    ps = ParallelState.initialize(ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                                 expert_model_parallel_size=ep))
    loaded = load_inference_model(checkpoint, ps)
    engine = BatchEngine(loaded, 4)
    real_check, calls = engine.check, itertools.count()

    def check(admissions):
        if rank == 1 and next(calls) == 2:  # rank 1 alone fails the third step's checks
            raise RuntimeError("injected fault on rank 1")
        return real_check(admissions)

    engine.check = check
    if rank != 0:
        run_follower_loop(loaded, engine)
        return None
    scheduler = Scheduler(loaded, engine, lambda ids: " ".join(map(str, ids)), max_queued=8)
    running = Job([5, 9, 13], Sampling(max_tokens=4, temperature=0))
    scheduler.submit([running])
    scheduler.step()
    joining = Job([7], Sampling(max_tokens=3, temperature=0))
    scored = Job([1, 2, 3, 4], Sampling(max_tokens=1, temperature=0, logprobs=2, echo=True))
    scheduler.submit([joining, scored])
    scheduler.step()  # both join the running sequence's second step
    scheduler.step()  # the fault
    after = Job([5, 9, 13], Sampling(max_tokens=4, temperature=0))
    scheduler.submit([after])
    while not after.done:
        scheduler.step()
    gone = Job([5, 9], Sampling(max_tokens=6, temperature=0))
    pair = [Job([1, 2, 3, 4], Sampling(max_tokens=3, temperature=0)), Job([7], Sampling(max_tokens=6, temperature=0))]
    scheduler.submit([gone, *pair])  # slots 0, 1, 2, prefilled together
    scheduler.step()
    scheduler.step()
    scheduler.cancel([gone])  # its client left: slot 0 is freed on both ranks at the next step ...
    while not all(job.done for job in pair):
        scheduler.step()
    reuse = Job([1, 2, 3, 4], Sampling(max_tokens=2, temperature=0))  # ... where slot 2's sequence moves (on both)
    scheduler.submit([reuse])
    while not reuse.done:
        scheduler.step()
    scheduler.stop()
    scheduler.run()  # nothing left: tells rank 1 to stop
    assert gone.choices[0].slot == pair[1].choices[0].slot == 0  # the freed slot took the sequence of slot 2
    return {"errors": [job.error for job in (running, joining, scored, after, reuse, *pair)],
            "tokens": [job.choices[0].tokens for job in (running, joining, scored, after, reuse, *pair)],
            "scores": scored.prompt_scores.cpu()}


MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear"]


@pytest.mark.parametrize("tp,pp,ep", [(2, 1, 1), (1, 2, 1), (1, 1, 2)])
def test_batched_steps_stay_in_lockstep_and_a_fault_of_one_rank_ends_the_batch_on_all(tmp_path, tp, pp, ep):
    checkpoint = tiny_checkpoint(str(tmp_path), layers=2, flags=MOE if ep > 1 else [])
    result, follower = run_distributed(worker, 2, checkpoint, tp, pp, ep, timeout=120)
    assert follower is None
    loaded = load_inference_model(checkpoint, ParallelState.single_process(torch.device("cpu")))

    def greedy(ids: list[int], n: int) -> list[int]:
        return generate(loaded.model, [ids], GenerationParams(max_new_tokens=n), eod=loaded.eod,
                        vocab_size=loaded.vocab_size)[0][0].token_ids

    running, joining, scored, after, reuse, *pair = result["tokens"]
    errors = result["errors"]
    assert errors[5:] == [None, None] and pair == [greedy([1, 2, 3, 4], 3), greedy([7], 6)]  # 3 then 2 rows a step
    assert errors[0] == errors[1] and errors[0][0] == 500 and "injected fault on rank 1" in errors[0][1]
    assert errors[2] is None and errors[3] is None  # the scored prompt had ended; the next request ran
    assert errors[4] is None and reuse == greedy([1, 2, 3, 4], 2)  # a cancelled sequence's slot, freed on both
    assert running == greedy([5, 9, 13], 4)[:2] and joining == greedy([7], 3)[:1]  # the tokens before the fault
    assert after == greedy([5, 9, 13], 4) and scored == greedy([1, 2, 3, 4], 1)
    with torch.no_grad():
        logp = loaded.model[0](torch.tensor([[1, 2, 3, 4]]), torch.arange(4)[None])[0, :, : loaded.vocab_size]
    logp = logp.float().log_softmax(-1)[:-1]
    expected = logp.gather(1, torch.tensor([[2], [3], [4]])).squeeze(1)
    torch.testing.assert_close(result["scores"][:, 0].float(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(result["scores"][:, 1:3].float(), logp.topk(2).values, atol=1e-5, rtol=1e-5)
