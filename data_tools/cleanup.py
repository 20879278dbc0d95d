"""Clean a jsonl corpus: repair text with ftfy, keep English, drop short documents.

    python data_tools/cleanup.py --input raw.jsonl --output clean.jsonl --min-tokens 128 --workers 4

Per document (the ``--text-key`` field; other fields are kept): ``ftfy.fix_text`` (mojibake, bad
escapes), then the English heuristic (``is_english``), then the length floor in GPT-2 tokens
(``--min-tokens``) and characters (``--min-chars``). Output order = input order. A summary of kept and
dropped counts by reason goes to stderr. Exit status: 0 done, 1 fatal (no input), 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter

import _common
import regex

from megatron_like.config import QuietArgumentParser

# The most frequent English function words; their share of the words separates English from other
# languages and from code or tables (GPT-2's WebText used langdetect for the same purpose).
_COMMON_ENGLISH_TEXT = (
    "the of and to a in is that it for as was with be by on not he i this are or his from at which but "
    "have an they you were her she there been one all we their has would when if so no will more can who "
    "its what about into than them only other do may these some such should also how each"
)
COMMON_ENGLISH = frozenset(_COMMON_ENGLISH_TEXT.split())
_WORD = regex.compile(r"\p{L}+")


def is_english(text: str, min_common_share: float = 0.08, min_latin_share: float = 0.9) -> bool:
    """Return whether ``text`` looks like English prose.

    Needs letters that are mostly ASCII (``min_latin_share`` of all letters) and common English words
    making up at least ``min_common_share`` of its words.
    """
    words = _WORD.findall(text)
    if not words:
        return False
    letters = sum(len(w) for w in words)
    ascii_letters = sum(len(w) for w in words if w.isascii())
    if ascii_letters < min_latin_share * letters:
        return False
    common = sum(1 for w in words if w.lower() in COMMON_ENGLISH)
    return common >= min_common_share * len(words)


_state: dict = {}


def _init(args: argparse.Namespace) -> None:
    _state["args"] = args
    if args.min_tokens > 0:
        from megatron_like.data.tokenizer import build_tokenizer

        _state["tokenizer"] = build_tokenizer("GPT2BPETokenizer", args.vocab_file, args.merge_file)


def clean_batch(lines: list[bytes]) -> list[tuple[str, str | None]]:
    """Return (outcome, output line or None) per raw line; outcome 'kept' or the reason dropped."""
    import ftfy

    args = _state["args"]
    out: list[tuple[str, str | None]] = []
    for raw in lines:
        try:
            obj = json.loads(raw)
            text = obj[args.text_key]
            if not isinstance(text, str):
                raise TypeError
        except (ValueError, KeyError, TypeError, RecursionError):
            out.append(("unreadable", None))
            continue
        if not args.no_ftfy:
            text = ftfy.fix_text(text)
        if len(text) < args.min_chars:
            out.append(("too_short", None))
        elif not args.no_language_filter and not is_english(text):
            out.append(("not_english", None))
        elif args.min_tokens > 0 and len(_state["tokenizer"].tokenize(text)) < args.min_tokens:
            out.append(("too_short", None))
        else:
            obj[args.text_key] = text
            out.append(("kept", json.dumps(obj, ensure_ascii=False)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = QuietArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, help="jsonl(.gz) file, directory or glob")
    parser.add_argument("--output", required=True, help="cleaned jsonl (.gz to compress)")
    parser.add_argument("--text-key", default="text")
    parser.add_argument("--min-tokens", type=int, default=128, help="GPT-2 tokens a document needs (0: off)")
    parser.add_argument("--min-chars", type=int, default=0, help="characters a document needs")
    parser.add_argument("--no-ftfy", action="store_true", help="skip the ftfy repair")
    parser.add_argument("--no-language-filter", action="store_true", help="keep non-English documents")
    parser.add_argument("--vocab-file", default=None, help="tokenizer for --min-tokens (default GPT-2)")
    parser.add_argument("--merge-file", default=None)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--log-interval", type=int, default=10000)
    args = parser.parse_args(argv)
    files = _common.input_files_or_exit(args.input)
    counts: Counter = Counter()
    progress = _common.Progress(args.log_interval)
    lines = (raw for _, _, raw in _common.iter_json_docs(files) if raw.strip())
    batches = _common.batched(lines, 256)
    with _common.open_text_out(args.output) as out:
        for results in _common.ordered_map(clean_batch, batches, args.workers, _init, (args,)):
            for outcome, line in results:
                counts[outcome] += 1
                if line is not None:
                    out.write(line + "\n")
            progress.update(len(results), 0)
    total = sum(counts.values())
    dropped = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()) if k != "kept") or "none"
    print(f"kept {counts['kept']} of {total} documents; dropped {dropped}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
