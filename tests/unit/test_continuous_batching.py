"""Continuous batching on one process (megatron_like/inference/{slot_cache,batching,scheduler}.py): sequences that
join a running batch at different steps, with prompts of different lengths, get exactly the tokens ``generate``
gives each alone (GPT-2 learned positions; RoPE + grouped-query + sliding window; multi-latent attention), seeded
sampling does not depend on the batch, echo log-probabilities equal a full forward's, and the bounded queue
refuses what it cannot hold."""

from __future__ import annotations

import threading

import pytest
import torch

from megatron_like.config import ModelConfig
from megatron_like.inference import GenerationParams, generate
from megatron_like.inference.batching import ENDED, Admission, BatchEngine, prefill_groups, score_prompt
from megatron_like.inference.loading import InferenceModel
from megatron_like.inference.scheduler import Job, QueueFullError, Sampling, Scheduler, wait
from megatron_like.model import GPTModel
from megatron_like.parallel_state import ParallelState

VOCAB = 64
LAYOUTS = {
    "gpt2": {},
    "rope_gqa_window": {"position_embedding_type": "rope", "group_query_attention": True, "num_query_groups": 2,
                        "normalization": "RMSNorm", "swiglu": True, "window_size": "5,0"},
    "mla": {"position_embedding_type": "rope", "multi_latent_attention": True, "disable_bias_linear": True,
            "q_lora_rank": None, "kv_lora_rank": 16, "qk_head_dim": 8, "qk_pos_emb_head_dim": 8, "v_head_dim": 8},
}
PROMPTS = [[5, 9, 13, 2, 40, 7], [7], [30, 31, 32], [1, 2, 3, 4, 5, 6, 7, 8, 9]]


def tiny_loaded(layout: str) -> InferenceModel:
    config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32, hidden_dropout=0.0,
                         attention_dropout=0.0, vocab_size=VOCAB, init_method_std=0.3, **LAYOUTS[layout])
    model = GPTModel(config, ParallelState.single_process(torch.device("cpu")), vocab_size=VOCAB, seed=3).eval()
    holder = type("Config", (), {"model": config})()
    return InferenceModel([model], holder, None, VOCAB, None)


def alone(loaded: InferenceModel, prompt: list[int], n: int) -> list[int]:
    return generate(loaded.model, [prompt], GenerationParams(max_new_tokens=n), vocab_size=VOCAB)[0][0].token_ids


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sequences_joining_a_running_batch_get_their_greedy_tokens_alone(layout):
    loaded = tiny_loaded(layout)
    engine = BatchEngine(loaded, slots=4)
    joins = {0: [0], 2: [1, 2, 3]}  # step -> prompts admitted then (into slots 0..3); 9 and 3 tokens share a
    # prefill forward (the 3 left padded), the lone token gets its own (prefill_groups)
    steps = {0: 8, 1: 3, 2: 9, 3: 5}  # tokens each generates: prompt 1 ends first, then prompt 3 moves to its slot
    got: dict[int, list[int]] = {i: [] for i in range(len(PROMPTS))}
    prompt_in: dict[int, int] = {}  # slot -> the prompt whose sequence it holds
    widest, moves_seen = 0, []
    for step in range(16):
        admissions = [Admission([i], PROMPTS[i]) for i in joins.get(step, [])]
        prompt_in.update({i: i for i in joins.get(step, [])})
        out = engine.forward(admissions)
        if out.logits is None:
            break
        widest = max(widest, len(out.rows))
        choices = torch.zeros(len(out.rows), 2, dtype=torch.long)
        for row, slot in enumerate(out.rows):
            token = int(out.logits[row].argmax())
            prompt = prompt_in[slot]
            got[prompt].append(token)
            choices[row] = torch.tensor([token, ENDED if len(got[prompt]) == steps[prompt] else 0])
        moves = engine.commit(out.rows, choices)
        prompt_in = {moves.get(slot, slot): prompt for slot, prompt in prompt_in.items()
                     if len(got[prompt]) < steps[prompt]}  # the running ones, where they are now
        moves_seen += moves.items()
        assert sorted(engine.last_token) == list(range(len(engine.last_token)))  # running slots stay 0 .. k-1
    assert widest == 4 and moves_seen[0] == (3, 1)  # all four in one step; prompt 3 moved into prompt 1's slot
    for i, prompt in enumerate(PROMPTS):
        assert got[i] == alone(loaded, prompt, steps[i]), (layout, i)


def test_prompts_of_similar_lengths_share_a_prefill_and_padding_never_doubles_the_work():
    def widths(lengths: list[int]) -> list[list[int]]:
        return [[len(a.ids) for a in group] for group in prefill_groups([Admission([0], [1] * n) for n in lengths])]

    assert widths([32] * 16) == [[32] * 16]
    assert widths([1, 9, 3]) == [[9, 3], [1]]  # 9 + 3 padded to 2 x 9 = 18 <= 2 x 12; with the 1: 27 > 26
    assert widths([10] * 15 + [1000]) == [[1000, 10], [10] * 14]  # not sixteen rows of 1000
    for lengths in ([5, 80, 7, 33, 2, 64, 9, 1], [3, 3, 4, 100, 50, 51]):
        for group in widths(lengths):
            assert len(group) * group[0] <= 2 * sum(group)


def run_scheduler(loaded: InferenceModel, slots: int = 4) -> tuple[Scheduler, threading.Thread]:
    """A scheduler whose engine loop runs in a thread, as in the server."""
    engine = BatchEngine(loaded, slots)
    scheduler = Scheduler(loaded, engine, lambda ids: " ".join(map(str, ids)), max_queued=8)
    thread = threading.Thread(target=scheduler.run, daemon=True)
    thread.start()
    return scheduler, thread


def finish(jobs: list[Job]) -> None:
    for job in jobs:
        while wait(job, timeout=60) != "done":
            pass
        assert job.error is None, job.error


def test_requests_join_the_running_batch_and_seeded_sampling_does_not_depend_on_it():
    loaded = tiny_loaded("rope_gqa_window")
    scheduler = Scheduler(loaded, BatchEngine(loaded, 6), str, max_queued=8)  # driven step by step, no thread
    sampled = Sampling(max_tokens=6, temperature=0.8, top_k=20, seed=11, n=2)
    solo, second = Job([5, 9, 13], sampled), Job([5, 9, 13], Sampling(**{**vars(sampled), "seed": 12, "n": 1}))
    scheduler.submit([solo, second])
    while not (solo.done and second.done):
        scheduler.step()

    running = Job(PROMPTS[0], Sampling(max_tokens=7, temperature=0))
    scheduler.submit([running])
    assert scheduler.step() == [0]  # its prefill
    first = Job([5, 9, 13], sampled)
    noise = Job(PROMPTS[3], Sampling(max_tokens=5, temperature=1.0, seed=3))  # draws its own random numbers
    greedy = Job(PROMPTS[1], Sampling(max_tokens=2, temperature=0))
    scheduler.submit([greedy, first, noise])  # slots 1, (2, 3), 4: greedy ends first and noise moves to slot 1
    assert sorted(scheduler.step()) == [0, 1, 2, 3, 4]  # they joined the running sequence's next step
    while not all(job.done for job in (running, first, noise, greedy)):
        scheduler.step()
        assert all(choice.slot == slot for slot, (_, choice) in scheduler.active.items())
    assert noise.choices[0].slot == 1  # moved down (BatchEngine.commit), followed by the scheduler
    assert [c.tokens for c in first.choices] == [c.tokens for c in solo.choices]
    assert first.choices[0].tokens != first.choices[1].tokens  # choice i samples with seed + i ...
    assert first.choices[1].tokens == second.choices[0].tokens  # ... from its own copy of the prompt's cache
    for job in (running, greedy):
        n = job.sampling.max_tokens
        assert job.choices[0].tokens == alone(loaded, job.ids, n) and job.choices[0].finish_reason == "length"
    assert len(noise.choices[0].tokens) == 5


def test_sampling_draws_only_what_the_filters_keep():
    """Sampling with top-k 1, or a top-p only the most likely token reaches, is greedy decoding: the draw lands on a
    kept token (rows of one setting are drawn together, each from its own generator)."""
    loaded = tiny_loaded("gpt2")
    scheduler = Scheduler(loaded, BatchEngine(loaded, 4), str, max_queued=8)
    top_k = Job(PROMPTS[0], Sampling(max_tokens=6, temperature=1.5, top_k=1, seed=4, n=2))
    top_p = Job(PROMPTS[3], Sampling(max_tokens=6, temperature=0.5, top_p=1e-6, seed=5, n=2))
    scheduler.submit([top_k, top_p])
    while not (top_k.done and top_p.done):
        scheduler.step()
    for job in (top_k, top_p):
        assert [c.tokens for c in job.choices] == [alone(loaded, job.ids, 6)] * 2


def test_echo_logprobs_equal_a_full_forward_and_stop_strings_cut_the_text():
    loaded = tiny_loaded("gpt2")
    ids = [5, 9, 13, 2, 40]
    scores = score_prompt(loaded, ids, top=3)
    with torch.no_grad():
        logp = loaded.model[0](torch.tensor([ids]), torch.arange(5)[None])[0, :, :VOCAB].log_softmax(-1)
    torch.testing.assert_close(scores[:, 0].float(), logp[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1))
    torch.testing.assert_close(scores[:, 1:4].float(), logp[:-1].topk(3).values)
    assert scores[:, 4:].long().tolist() == logp[:-1].topk(3).indices.tolist()

    scheduler, thread = run_scheduler(loaded)
    greedy = alone(loaded, ids, 6)
    stop = " ".join(map(str, greedy[2:4]))
    job = Job(ids, Sampling(max_tokens=6, temperature=0, stop=[stop], logprobs=2, echo=True))
    scored_only = Job(ids, Sampling(max_tokens=0, logprobs=1, echo=True))
    scheduler.submit([job, scored_only])
    finish([job, scored_only])
    scheduler.stop()
    thread.join(timeout=60)
    choice = job.choices[0]
    ends = next(k for k in range(1, 7) if stop in " ".join(map(str, greedy[:k])))  # the stop may come early
    text = " ".join(map(str, greedy[:ends]))
    assert choice.finish_reason == "stop" and choice.tokens == greedy[:ends] and choice.text == text[:text.find(stop)]
    torch.testing.assert_close(torch.tensor(choice.token_logprobs), logp_of(loaded, ids, greedy[:ends]))
    assert scored_only.choices[0].tokens == [] and scored_only.prompt_scores.shape == (4, 3)


def logp_of(loaded: InferenceModel, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    ids = prompt + continuation
    with torch.no_grad():
        logp = loaded.model[0](torch.tensor([ids]), torch.arange(len(ids))[None])[0, :, :VOCAB].log_softmax(-1)
    return logp[len(prompt) - 1:-1].gather(1, torch.tensor(continuation)[:, None]).squeeze(1)


def test_the_queue_is_bounded():
    loaded = tiny_loaded("gpt2")
    scheduler = Scheduler(loaded, BatchEngine(loaded, 2), str, max_queued=2)  # no engine thread: nothing leaves
    scheduler.submit([Job([1], Sampling()), Job([2], Sampling())])
    with pytest.raises(QueueFullError, match="full"):
        scheduler.submit([Job([3], Sampling())])


def test_only_a_streamed_job_is_woken_at_every_step():
    """A plain answer's handler waits for "done" alone: waking 16 handler threads at every step made them take the
    GIL from the engine thread for nothing."""
    loaded = tiny_loaded("gpt2")
    scheduler = Scheduler(loaded, BatchEngine(loaded, 2), str, max_queued=2)
    plain = Job([1, 2], Sampling(max_tokens=4, temperature=0))
    streamed = Job([3], Sampling(max_tokens=4, temperature=0), streamed=True)
    scheduler.submit([plain, streamed])
    while not (plain.done and streamed.done):
        scheduler.step()
    plain_events, streamed_events = ([job.events.get_nowait() for _ in range(job.events.qsize())]
                                     for job in (plain, streamed))
    assert plain_events == ["done"] and streamed_events == ["update"] * 3 + ["done"]
