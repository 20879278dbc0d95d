"""Generation on one process: KV cache vs recomputation vs a naive loop, Hugging Face greedy and beam
search on converted weights, beam search vs brute force, sampling processors vs HF's warpers."""

from __future__ import annotations

import itertools

import pytest
import torch
import transformers  # a test dependency: missing, these tests fail

from megatron_like.config import ModelConfig
from megatron_like.inference import GenerationParams, generate, process_logits
from megatron_like.inference.hf_gpt2 import hf_config, to_hf_state
from megatron_like.model import GPTModel
from megatron_like.model.state import gather_full_state
from megatron_like.parallel_state import ParallelState


def tiny_model(vocab: int = 64, padded: int = 64, seed: int = 3, layers: int = 2, std: float = 0.02,
               untie: bool = False) -> GPTModel:
    config = ModelConfig(num_layers=layers, hidden_size=32, num_attention_heads=4, seq_length=64,
                         hidden_dropout=0.0, attention_dropout=0.0, vocab_size=vocab, init_method_std=std,
                         untie_embeddings_and_output_weights=untie)
    return GPTModel(config, ParallelState.single_process(torch.device("cpu")), vocab_size=padded, seed=seed).eval()


def hf_model(model: GPTModel, vocab: int, eod: int | None = None):
    """The GPT2LMHeadModel holding ``model``'s weights (through the converter under test)."""
    cfg = hf_config(model.config, vocab, eod)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**cfg)).eval()
    missing, unexpected = hf.load_state_dict(to_hf_state(gather_full_state([model]), model.config, vocab), strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if cfg["tie_word_embeddings"] else set())
    hf.tie_weights()
    return hf


@pytest.mark.parametrize("untie", [False, True])
def test_hf_conversion_keeps_logits_both_ways(untie):
    from megatron_like.inference.hf_gpt2 import from_hf_state, model_config_from_hf

    model, vocab = tiny_model(vocab=50, std=0.2, untie=untie), 50
    hf = hf_model(model, vocab, eod=7)
    ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(ids, torch.arange(12)[None].expand(2, -1))[..., :vocab]
        torch.testing.assert_close(hf(ids).logits, ours, rtol=1e-5, atol=1e-5)
    config = model_config_from_hf(hf.config.to_dict())
    assert config.untie_embeddings_and_output_weights == untie and config.ffn_size == 128
    back = from_hf_state(hf.state_dict(), config, padded_vocab_size=64)
    full = gather_full_state([model])
    assert set(back) == set(full)
    for name, tensor in full.items():
        torch.testing.assert_close(back[name][: vocab if "word" in name or "output" in name else None],
                                   tensor[: vocab if "word" in name or "output" in name else None], rtol=0, atol=0)


def naive_greedy(model: GPTModel, prompt: list[int], n: int, vocab: int) -> list[int]:
    """Greedy by full forward passes of the training path (no cache, no padding)."""
    tokens = list(prompt)
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([tokens]), torch.arange(len(tokens))[None])[0, -1, :vocab]
        tokens.append(int(logits.argmax()))
    return tokens[len(prompt):]


PROMPTS = [[1, 2, 3, 4, 5, 6], [7, 8], [9, 10, 11]]


def test_kv_cache_equals_recomputation_and_naive_loop_on_padded_batch():
    model = tiny_model(vocab=60, std=0.3)  # a large init: attention (and so the padding mask) matters
    cached = generate(model, PROMPTS, GenerationParams(max_new_tokens=12), vocab_size=60)
    uncached = generate(model, PROMPTS, GenerationParams(max_new_tokens=12, use_cache=False), vocab_size=60)
    naive = [naive_greedy(model, p, 12, 60) for p in PROMPTS]
    assert [g[0].token_ids for g in cached] == naive
    assert [g[0].token_ids for g in uncached] == naive
    # Batched sampling with left padding draws the same rows as unbatched only in distribution, but
    # greedy rows must not depend on their batch mates.
    alone = [generate(model, [p], GenerationParams(max_new_tokens=12), vocab_size=60)[0][0].token_ids for p in PROMPTS]
    assert alone == naive


def test_greedy_equals_hf_generate_on_converted_weights():
    model, vocab = tiny_model(vocab=50, std=0.2), 50
    hf = hf_model(model, vocab, eod=7)
    for prompt in PROMPTS:
        ours = generate(model, [prompt], GenerationParams(max_new_tokens=16, min_new_tokens=2), eod=7,
                        vocab_size=vocab)[0][0].token_ids
        ids = torch.tensor([prompt])
        theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=2,
                             do_sample=False, eos_token_id=7, pad_token_id=7)[0, len(prompt):].tolist()
        assert ours == theirs[: len(ours)] and all(t == 7 for t in theirs[len(ours):])


@pytest.mark.parametrize("length_penalty,early_stopping", [(1.0, False), (0.5, True), (2.0, "never")])
def test_beam_search_equals_hf_beam_search(length_penalty, early_stopping):
    vocab, eod = 12, 5  # a small vocabulary and a large init: hypotheses end at eod often
    model = tiny_model(vocab=vocab, padded=16, std=0.3, seed=11)
    hf = hf_model(model, vocab, eod=eod)
    for prompt in PROMPTS:
        params = GenerationParams(max_new_tokens=8, num_beams=4, num_return_sequences=3,
                                  length_penalty=length_penalty, early_stopping=early_stopping)
        ours = generate(model, [prompt], params, eod=eod, vocab_size=vocab)[0]
        ids = torch.tensor([prompt])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, num_beams=4,
                          num_return_sequences=3, length_penalty=length_penalty, early_stopping=early_stopping,
                          do_sample=False, eos_token_id=eod, pad_token_id=eod, output_scores=True,
                          return_dict_in_generate=True)
        for g, seq, score in zip(ours, out.sequences[:, len(prompt):].tolist(), out.sequences_scores.tolist()):
            assert g.token_ids == seq[: len(g.token_ids)] and all(t == eod for t in seq[len(g.token_ids):])
            assert g.score == pytest.approx(score, rel=1e-5, abs=1e-5)


def test_beam_search_with_enough_beams_finds_the_brute_force_best_sequences():
    vocab, steps = 4, 3
    model = tiny_model(vocab=vocab, padded=8, std=0.5, seed=5)
    prompt = [1, 2]

    def logprob(seq: tuple[int, ...]) -> float:
        tokens = torch.tensor([prompt + list(seq)])
        with torch.no_grad():
            logits = model(tokens, torch.arange(tokens.shape[1])[None])[0, :, :vocab].log_softmax(-1)
        return sum(float(logits[len(prompt) - 1 + i, t]) for i, t in enumerate(seq))

    brute = sorted(itertools.product(range(vocab), repeat=steps), key=logprob, reverse=True)[:3]
    params = GenerationParams(max_new_tokens=steps, num_beams=vocab ** (steps - 1), num_return_sequences=3,
                              length_penalty=0.0)
    ours = generate(model, [prompt], params, vocab_size=vocab)[0]
    assert [tuple(g.token_ids) for g in ours] == brute
    assert [g.score for g in ours] == pytest.approx([logprob(s) for s in brute], abs=1e-5)


def test_sampling_processors_equal_hf_warpers_and_seeded_sampling_repeats():
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3
    theirs = TopPLogitsWarper(0.8)(None, TopKLogitsWarper(10)(None, TemperatureLogitsWarper(0.7)(None, logits)))
    ours = process_logits(logits, temperature=0.7, top_k=10, top_p=0.8)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    torch.testing.assert_close(ours[~torch.isinf(ours)], theirs[~torch.isinf(theirs)])

    model = tiny_model(vocab=60)
    params = GenerationParams(max_new_tokens=10, do_sample=True, top_k=20, top_p=0.9, temperature=0.8, seed=7,
                              num_return_sequences=2)
    first = generate(model, PROMPTS, params, vocab_size=60)
    assert first == generate(model, PROMPTS, params, vocab_size=60)
    assert all(len(seqs) == 2 for seqs in first)
    greedy_like = GenerationParams(max_new_tokens=10, do_sample=True, top_k=1, seed=3)
    assert [g[0].token_ids for g in generate(model, PROMPTS, greedy_like, vocab_size=60)] == \
        [naive_greedy(model, p, 10, 60) for p in PROMPTS]


def test_stops_at_end_of_text_but_not_before_min_new_tokens():
    model = tiny_model(vocab=60)
    first = generate(model, [PROMPTS[0]], GenerationParams(max_new_tokens=6), vocab_size=60)[0][0].token_ids
    eod = first[2]  # the third greedy token: make it the end of text
    stopped = generate(model, [PROMPTS[0]], GenerationParams(max_new_tokens=6), eod=eod, vocab_size=60)[0][0]
    assert stopped.token_ids[-1] == eod and eod not in stopped.token_ids[:-1] and len(stopped.token_ids) <= 3
    longer = generate(model, [PROMPTS[0]], GenerationParams(max_new_tokens=6, min_new_tokens=6), eod=eod,
                      vocab_size=60)[0][0]
    assert len(longer.token_ids) == 6 and eod not in longer.token_ids


def test_invalid_requests_are_refused():
    model = tiny_model(vocab=60)
    with pytest.raises(ValueError, match="exceeds the model's 64 positions"):
        generate(model, [[1] * 60], GenerationParams(max_new_tokens=10), vocab_size=60)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generate(model, [[61]], GenerationParams(), vocab_size=60)
    with pytest.raises(ValueError, match="top_p"):
        generate(model, [[1]], GenerationParams(do_sample=True, top_p=0.0), vocab_size=60)
    with pytest.raises(ValueError, match="num_return_sequences"):
        generate(model, [[1]], GenerationParams(num_beams=2, num_return_sequences=3), vocab_size=60)


def test_prepacked_weights_give_the_same_logits_and_tokens_and_leave_training_alone():
    from megatron_like.inference.packed_linear import available, ensure_packed, unpack_linears

    if not available():
        pytest.skip("this torch build has neither oneDNN nor MKL packed GEMM")
    model = tiny_model(vocab=60, std=0.3)
    keys = sorted(model.state_dict())
    ids, pos = torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.arange(3)[None].expand(2, -1)
    step_ids, step_pos = torch.tensor([[7], [8], [9]]), torch.tensor([[0], [1], [2]])  # 3 rows: the packed path
    with torch.no_grad():
        plain, plain_step = model(ids, pos), model(step_ids, step_pos)
    params = GenerationParams(max_new_tokens=8)
    expected = generate(model, PROMPTS, params, vocab_size=60)
    ensure_packed([model], len(PROMPTS))
    assert "forward" in model.output_layer.__dict__ and sorted(model.state_dict()) == keys
    with torch.no_grad():
        torch.testing.assert_close(model(step_ids, step_pos), plain_step, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model(ids, pos), plain, rtol=1e-5, atol=1e-5)  # 6 rows: falls back
    packed = generate(model, PROMPTS, params, vocab_size=60)
    assert [g[0].token_ids for g in packed] == [g[0].token_ids for g in expected]
    assert [g[0].score for g in packed] == pytest.approx([g[0].score for g in expected], rel=1e-5)
    model.train()  # training mode (and autograd) use the class forward
    model(ids, pos, labels=ids).mean().backward()
    assert model.embedding.word_embeddings.weight.grad is not None
    unpack_linears([model])
    assert "forward" not in model.output_layer.__dict__
