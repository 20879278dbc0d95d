"""The server's answer text, decoded a few tokens at a time (megatron_like/inference/detokenize.py), equals one decode
of every token after each token: GPT-2's byte-level BPE with characters split over several tokens and random ids
(invalid UTF-8 included), a space-separated id list, a SentencePiece-style tokenizer whose tokens decoded alone lose
their leading space; stop strings that span tokens or a split character end the answer at the same token and cut it
at the same place as a search of the whole text."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from megatron_like.data.tokenizer import NullTokenizer, build_tokenizer
from megatron_like.inference.detokenize import MAX_PENDING, IncrementalText, first_stop
from megatron_like.inference.scheduler import Job, Sampling, Scheduler

TEXT = "héllo 🤖 世界! naïve café 🇫🇷 ok 😀😀 end"


@pytest.fixture(scope="module")
def gpt2():
    return build_tokenizer(None)


def sequences(gpt2) -> list[list[int]]:
    ids = gpt2.tokenize(TEXT)
    assert any("\ufffd" in gpt2.detokenize([i]) for i in ids)  # some characters are split over tokens
    rng = random.Random(0)
    noise = [[rng.randrange(gpt2.vocab_size - 1) for _ in range(40)] for _ in range(3)]
    bytes_only = [[rng.choice(ids) for _ in range(40)] for _ in range(3)]  # pieces of characters in any order
    # single bytes >= 0x80 in any order: text that ends in "\ufffd" after every token, a character never forms
    lone = [i for i in range(256) if gpt2.detokenize([i]) == "\ufffd"]
    garbage = [[rng.choice(lone) for _ in range(40)]]
    return [ids] + noise + bytes_only + garbage


def metaspace_tokenizer():
    """A SentencePiece-style BPE (``▁`` for spaces; decoding drops the leading one), trained on two lines."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer, tokenizer.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    tokenizer.train_from_iterator(["hello world, the quick brown fox", "héllo wörld again"] * 5,
                                  trainers.BpeTrainer(vocab_size=80, special_tokens=["<unk>"]))
    return tokenizer


def test_text_equals_one_decode_of_every_token_after_each_token(gpt2):
    null, metaspace = NullTokenizer(1000), metaspace_tokenizer()
    spaced = metaspace.encode("hello the quick wörld again").ids
    assert metaspace.decode(spaced[1:2]) == "the"  # alone a token loses its space: the window's context keeps it
    cases = [(gpt2.detokenize, ids) for ids in sequences(gpt2)]
    cases += [(null.detokenize, [5, 17, 0, 999, 3]), (lambda ids: "".join(f" {t}" for t in ids), [5, 17, 0, 3]),
              (lambda ids: metaspace.decode(list(ids)), spaced)]
    for case, (detokenize, ids) in enumerate(cases):
        decoded = IncrementalText(detokenize)
        for k, token in enumerate(ids, 1):
            assert decoded.push(token) == detokenize(ids[:k]), (ids[:k], decoded.text)
            assert not decoded.confirmed.endswith("\ufffd") or "\ufffd" in detokenize(ids[:k - 1])
            assert decoded.text.startswith(decoded.confirmed)
            # the window stays short, also over garbage bytes that never form a character (random ids, pieces)
            assert len(decoded.tokens) - decoded._context < 3 * MAX_PENDING, (case, k)


def test_first_stop_equals_a_search_of_the_whole_text():
    rng = random.Random(1)
    for _ in range(300):
        text = "".join(rng.choice("ab c") for _ in range(30))
        stops = ["".join(rng.choice("ab c") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        searched = 0
        for end in range(1, len(text) + 1):  # the text grows a character at a time, as an answer does
            whole = [i for i in (text[:end].find(s) for s in stops) if i >= 0]
            assert first_stop(text[:end], stops, searched) == (min(whole) if whole else None)
            if whole:
                break
            searched = end


def test_the_scheduler_ends_at_a_stop_spanning_tokens_and_a_split_character(gpt2):
    # _record reads only the end-of-text id and the positions of the model: no model is built
    loaded, engine = SimpleNamespace(eod=gpt2.eod), SimpleNamespace(max_length=64)
    scheduler = Scheduler(loaded, engine, gpt2.detokenize, max_queued=1)
    ids = gpt2.tokenize(TEXT)
    for stop in ["o 🤖 世", "🤖", "界!", "é 🇫", "😀😀 e", "never"]:
        job = Job([1], Sampling(max_tokens=len(ids) + 1, temperature=0, stop=[stop, "zz"]))
        choice = job.choices[0]
        for k, token in enumerate(ids, 1):
            scheduler._record(job, choice, token, None)
            whole = gpt2.detokenize(ids[:k])
            if stop in whole:  # ends at the first token whose text holds the stop, cut before it
                assert choice.finish_reason == "stop" and choice.text == whole[:whole.find(stop)], (stop, k)
                break
            assert choice.finish_reason is None and choice.text == whole
        else:  # no stop: end of text ends it, its text is every token's
            assert stop == "never"
            scheduler._record(job, choice, gpt2.eod, None)
            assert choice.finish_reason == "stop" and choice.text == TEXT
