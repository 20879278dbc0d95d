"""GPT-2 BPE equals GPT-2: fixed ids, a pure-Python BPE and transformers' slow tokenizer as references."""

import importlib.util
import json

import pytest

from megatron_like.data.gpt2_bpe_reference import PurePythonGPT2BPETokenizer, bytes_to_unicode
from megatron_like.data.tokenizer import (
    GPT2BPETokenizer,
    HuggingFaceTokenizer,
    NullTokenizer,
    build_tokenizer,
    default_gpt2_files,
)

TRICKY = [
    "Hello world",
    " Hello  world ",
    "It's the cat's toy; they'll go, we've been, I'm here, you'd see, don't.",
    "IT'S LOUD'S",  # GPT-2's contraction rule is case-sensitive
    "Numbers: 3.14159, 1,000,000 and 2024-01-01 12:34:56",
    "tabs\tand\nnewlines\n\n\n  indented\r\n",
    "whitespace runs          end   ",
    "unicode: café naïve façade Æsir Ωmega 日本語 한국어 русский عربى",
    "emoji 😀👍🏽👨‍👩‍👧 flags 🇫🇷",
    "zero\u200bwidth and non\u00a0breaking",
    "code: def f(x):\n    return x**2  # comment",
    "<html><body>&amp; 'quoted' \"double\"</body></html>",
    "",
    "   ",
    "'s's's",
]


ENGINES = [
    "tokenizers",
    pytest.param(
        "tiktoken",
        marks=pytest.mark.skipif(importlib.util.find_spec("tiktoken") is None, reason="tiktoken not installed"),
    ),
]


@pytest.fixture(scope="module", params=ENGINES)
def fast(request):
    tok = GPT2BPETokenizer(engine=request.param)
    assert tok.engine == request.param
    return tok


@pytest.fixture(scope="module")
def slow():
    return PurePythonGPT2BPETokenizer()


def test_known_ids(fast):
    assert fast.tokenize("Hello world") == [15496, 995]
    assert fast.eod == 50256
    assert fast.vocab_size == 50257
    assert fast.tokenize(" the") == [262]


@pytest.mark.parametrize("text", TRICKY)
def test_fast_equals_pure_python_reference(fast, slow, text):
    ids = fast.tokenize(text)
    assert ids == slow.tokenize(text)
    assert fast.detokenize(ids) == text
    assert slow.detokenize(ids) == text


def test_fast_equals_transformers_slow_tokenizer(fast):
    import transformers  # a test dependency: missing, this fails
    vocab, merges = default_gpt2_files()
    hf = transformers.GPT2Tokenizer(vocab, merges)
    for text in TRICKY:
        assert fast.tokenize(text) == hf.encode(text), text


def test_batch_equals_single(fast):
    assert fast.tokenize_batch(TRICKY) == [fast.tokenize(t) for t in TRICKY]


def test_arrays_equal_lists(fast, slow):
    # preprocess.py tokenizes through tokenize_arrays (tiktoken's buffer, no Python ints); the ids must
    # be those of tokenize, "<|endoftext|>" in a text included.
    texts = [*TRICKY, "a<|endoftext|>b"]
    for tok, cases in ((fast, texts), (slow, texts), (NullTokenizer(10), ["1 2 3", ""])):
        arrays = tok.tokenize_arrays(cases)
        assert all(a.ndim == 1 and a.dtype.kind in "iu" for a in arrays)
        assert [a.tolist() for a in arrays] == [tok.tokenize(t) for t in cases]


def test_endoftext_in_text_is_plain_text(fast, slow):
    # A corpus cannot inject end-of-document ids: OpenAI's encoder treats the string as text.
    ids = fast.tokenize("a<|endoftext|>b")
    assert 50256 not in ids
    assert ids == slow.tokenize("a<|endoftext|>b")


def test_bytes_to_unicode_is_a_bijection():
    mapping = bytes_to_unicode()
    assert len(set(mapping.values())) == 256
    assert mapping[ord("A")] == "A" and mapping[ord(" ")] == "\u0120"


def test_custom_files_and_errors(tmp_path):
    vocab = {"<|endoftext|>": 0, **{c: i + 1 for i, c in enumerate(sorted(set(bytes_to_unicode().values())))}}
    vocab["ab"] = len(vocab)
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\na b\n")
    tok = build_tokenizer("GPT2BPETokenizer", str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"))
    assert tok.eod == 0 and tok.vocab_size == 258
    assert tok.tokenize("ab") == [vocab["ab"]]
    assert (
        GPT2BPETokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"), "tokenizers").tokenize("abab")
        == [vocab["ab"]] * 2
    )
    with pytest.raises(FileNotFoundError, match="--vocab-file"):
        build_tokenizer("GPT2BPETokenizer", str(tmp_path / "nope.json"), str(tmp_path / "merges.txt"))
    with pytest.raises(ValueError, match="both"):
        build_tokenizer("GPT2BPETokenizer", str(tmp_path / "vocab.json"))
    with pytest.raises(ValueError, match="not one of"):
        build_tokenizer("SentencePieceTokenizer")


def test_huggingface_tokenizer_json(tmp_path, fast):
    fast._engine.save(str(tmp_path / "tokenizer.json"))  # the tokenizers engine, whatever encodes
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    assert tok.eod == 50256
    assert tok.tokenize(TRICKY[2]) == fast.tokenize(TRICKY[2])
    with pytest.raises(ValueError, match="--tokenizer-model"):
        build_tokenizer("HuggingFaceTokenizer")


def test_null_tokenizer():
    tok = build_tokenizer("NullTokenizer", vocab_size=100)
    assert isinstance(tok, NullTokenizer)
    assert tok.vocab_size == 101 and tok.eod == 100
    assert tok.tokenize("5 7 99") == [5, 7, 99]
    assert tok.detokenize([5, 7]) == "5 7"
    assert isinstance(build_tokenizer(None), GPT2BPETokenizer)
    assert HuggingFaceTokenizer.EOD_CANDIDATES[0] == "<|endoftext|>"
