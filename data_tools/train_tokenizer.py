"""Train a GPT-2-style byte-level BPE on a jsonl corpus; write GPT-2-format ``vocab.json`` and ``merges.txt``.

    python data_tools/train_tokenizer.py --input corpus.jsonl --output-dir tok --vocab-size 4096

The tokenizer has GPT-2's pre-tokenization regex and byte alphabet (all 256 bytes are tokens, so any
text encodes) and ``<|endoftext|>`` as its end-of-document token. Use the result with
``--tokenizer-type GPT2BPETokenizer --vocab-file tok/vocab.json --merge-file tok/merges.txt``.
Training uses Hugging Face ``tokenizers`` (Rust); the same corpus and settings give the same files.
"""

from __future__ import annotations

import json
import os
import sys

import _common

from megatron_like.config import QuietArgumentParser

EOD = "<|endoftext|>"


def iter_texts(files: list[str], key: str, counts: dict):
    """Yield the ``key`` text of every readable jsonl line; count the unreadable ones."""
    for _, _, raw in _common.iter_json_docs(files):
        if not raw.strip():
            continue
        try:
            text = json.loads(raw)[key]
        except (ValueError, KeyError, TypeError):
            counts["unreadable"] += 1
            continue
        if isinstance(text, str) and text:
            counts["documents"] += 1
            yield text
        else:
            counts["unreadable"] += 1


def train(files: list[str], key: str, vocab_size: int, min_frequency: int, output_dir: str) -> dict:
    """Train, save vocab.json/merges.txt/tokenizer.json under ``output_dir``; return counts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    counts = {"documents": 0, "unreadable": 0}
    tokenizer.train_from_iterator(iter_texts(files, key, counts), trainer=trainer)
    os.makedirs(output_dir, exist_ok=True)
    tokenizer.model.save(output_dir)  # GPT-2 format: vocab.json + merges.txt ("#version: 0.2" header)
    tokenizer.save(os.path.join(output_dir, "tokenizer.json"))
    counts["vocab_size"] = tokenizer.get_vocab_size()
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = QuietArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, help="jsonl(.gz) file, directory or glob")
    parser.add_argument("--output-dir", required=True, help="writes vocab.json, merges.txt, tokenizer.json")
    parser.add_argument("--json-key", default="text")
    parser.add_argument("--vocab-size", type=int, default=4096, help="including 256 bytes and <|endoftext|>")
    parser.add_argument("--min-frequency", type=int, default=2, help="occurrences a merge needs")
    args = parser.parse_args(argv)
    if args.vocab_size < 257:
        parser.error(f"--vocab-size {args.vocab_size} must be >= 257 (256 bytes + <|endoftext|>)")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    try:
        counts = train(
            _common.resolve_inputs(args.input),
            args.json_key,
            args.vocab_size,
            args.min_frequency,
            args.output_dir,
        )
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if counts["documents"] == 0:
        print("error: no documents with text in the input", file=sys.stderr)
        return 1
    print(
        f"trained on {counts['documents']} documents ({counts['unreadable']} unreadable skipped): "
        f"vocabulary {counts['vocab_size']} -> {args.output_dir}/vocab.json, merges.txt",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
