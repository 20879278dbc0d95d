"""Binarize a jsonl corpus into Megatron mmap datasets (``<output-prefix>_<key>_document.{bin,idx}``).

    python data_tools/preprocess.py --input corpus.jsonl --output-prefix data/my-gpt2 \\
        --tokenizer-type GPT2BPETokenizer --append-eod --workers 8

Streaming in bounded memory: the main process reads raw lines in batches, ``--workers`` processes parse
and tokenize them, and the results are written in input order (at most ``2 * workers`` batches in
flight). A UTF-8 byte-order mark at the start of a line is ignored (each file of a corpus concatenated
from files saved on Windows may carry one). Bad lines are skipped and counted by kind (undecodable,
blank_line, invalid_json, not_an_object, missing_key, not_string, empty_text, tokenizer_error); a line
is written for all ``--json-keys`` or for none, so the datasets of several keys stay aligned. Outputs are written under
temporary names and renamed at the end. ``--split-sentences`` writes ``_sentence`` datasets (one
sequence per sentence, Megatron's naming).

Exit status: 0 when the datasets were written (bad lines, if any, are reported on stderr); 1 on a fatal
error (no input, unreadable tokenizer, no good document: nothing is written); 2 on a usage error;
130 when interrupted (temporary files are removed).
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import multiprocessing
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import _common  # noqa: F401 - puts the repo on sys.path when run from a checkout
import numpy as np
import regex

from megatron_like.config import QuietArgumentParser
from megatron_like.data.indexed_dataset import IndexedDatasetBuilder, best_fitting_dtype
from megatron_like.data.tokenizer import build_tokenizer

BAD_KINDS = (
    "undecodable",
    "blank_line",
    "invalid_json",
    "not_an_object",
    "missing_key",
    "not_string",
    "empty_text",
    "tokenizer_error",
)
FIRST_LINES_KEPT = 5
# Windows tools start a UTF-8 file (and every file concatenated into a corpus) with a byte-order mark;
# json.loads refuses it in a str, so it is dropped before decoding (as json.loads does for bytes).
UTF8_BOM = b"\xef\xbb\xbf"
# A sentence ends at . ! ? (with closing quotes/brackets) before whitespace and a capital, digit or quote.
_SENTENCE_BREAK = regex.compile(r"(?<=[.!?][\"')\]]*)(?=\s+[\"'(\[]?[\p{Lu}\p{N}])")


def split_sentences(text: str) -> list[str]:
    """Return the sentences of ``text``; joined they give ``text`` back (whitespace leads each sentence)."""
    return [s for s in _SENTENCE_BREAK.split(text) if s]


@dataclass
class Stats:
    """Counts of one run (or partition); ``first_bad`` keeps the first few 'file:line' of each kind."""

    lines: int = 0
    docs: int = 0
    tokens: int = 0
    bytes: int = 0
    bad: Counter = field(default_factory=Counter)
    first_bad: dict = field(default_factory=dict)

    def add_bad(self, kind: str, where: str) -> None:
        self.bad[kind] += 1
        kept = self.first_bad.setdefault(kind, [])
        if len(kept) < FIRST_LINES_KEPT:
            kept.append(where)

    def merge(self, other: Stats) -> None:
        self.lines += other.lines
        self.docs += other.docs
        self.tokens += other.tokens
        self.bytes += other.bytes
        for kind, count in other.bad.items():
            self.bad[kind] += count
            kept = self.first_bad.setdefault(kind, [])
            kept.extend(other.first_bad.get(kind, [])[: FIRST_LINES_KEPT - len(kept)])


# ---------------------------------------------------------------------------------------------------
# Worker side: raw lines -> token arrays.

_worker: dict = {}


def _init_worker(args: argparse.Namespace, tokenizer=None) -> None:
    """Set this process's worker state: ``args``, the tokenizer (built unless given) and the token dtype."""
    tokenizer = tokenizer if tokenizer is not None else _build_tokenizer(args)
    _worker.update(args=args, tokenizer=tokenizer, dtype=best_fitting_dtype(tokenizer.vocab_size))


def _build_tokenizer(args: argparse.Namespace):
    return build_tokenizer(args.tokenizer_type, args.vocab_file, args.merge_file, args.tokenizer_model, args.vocab_size)


def _encodable(texts: list[str]) -> bool:
    """Return whether every text encodes to UTF-8 (False when a JSON escape left a lone surrogate)."""
    try:
        for text in texts:
            text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _parse_line(raw: bytes, keys: list[str], split: bool) -> tuple[str, dict[str, list[str]] | None]:
    """Return ('ok', {key: texts}) or (bad kind, None) for one raw jsonl line (a leading BOM is ignored)."""
    if raw.startswith(UTF8_BOM):
        raw = raw[len(UTF8_BOM) :]
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError:
        return "undecodable", None
    if not line or line.isspace():  # not line.strip(), which copies the line
        return "blank_line", None
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError):
        return "invalid_json", None
    if not isinstance(obj, dict):
        return "not_an_object", None
    # Only a \uD800-\uDFFF escape decodes to a surrogate (the line itself is valid UTF-8), so the
    # encode check (a copy of every text) runs only on lines that hold one.
    may_hold_surrogates = b"\\ud" in raw or b"\\uD" in raw
    texts: dict[str, list[str]] = {}
    for key in keys:
        if key not in obj:
            return "missing_key", None
        value = obj[key]
        if isinstance(value, str):
            pieces = [value]
        elif isinstance(value, list) and all(isinstance(v, str) for v in value):
            pieces = value  # already split into sentences
        else:
            return "not_string", None
        if may_hold_surrogates and not _encodable(pieces):  # lone surrogates: no tokenizer can encode them
            return "undecodable", None
        if split:
            pieces = [s for p in pieces for s in split_sentences(p)]
        texts[key] = pieces
    return "ok", texts


def _tokenize_all(tokenizer, texts: list[str]) -> list[np.ndarray | None]:
    """Return the ids [ids] of each text; None where the tokenizer rejects it (then retried one by one)."""
    if not texts:
        return []
    try:
        return tokenizer.tokenize_arrays(texts)
    except Exception:
        out: list[np.ndarray | None] = []
        for text in texts:
            try:
                out.append(tokenizer.tokenize_arrays([text])[0])
            except Exception:
                out.append(None)
        return out


def _split_lines(blob: bytes) -> list[bytes]:
    """Return the lines of ``blob`` (whole lines, each ended by b'\\n' but perhaps the last) without
    their line ends, as ``_common.iter_lines`` yields them."""
    lines = blob.split(b"\n")
    if blob.endswith(b"\n"):
        lines.pop()
    return [line.rstrip(b"\r") for line in lines]


def encode_batch(batch: tuple[str, int, bytes]) -> tuple[list[tuple[str, str]], dict, int, int]:
    """Return (bad [(kind, 'file:line')], {key: (tokens, sequence lengths, sequences per doc)}, docs, bytes).

    ``batch`` is (file, number of its first line, raw bytes of consecutive whole lines): one bytes object
    is cheap to pickle to a worker, and splitting it here keeps per-line work out of the main process.
    Per key: tokens [sum(sequence lengths)] in the dataset dtype, sequence lengths [sequences] and
    sequences per doc [docs], both int64; documents are in input order.
    """
    args, tokenizer, dtype = _worker["args"], _worker["tokenizer"], _worker["dtype"]
    keys = args.json_keys
    path, first_line, blob = batch
    lines = _split_lines(blob)
    bad: list[tuple[str, str]] = []
    parsed: list[tuple[int, dict[str, list[str]]]] = []
    for i, raw in enumerate(lines):
        kind, texts = _parse_line(raw, keys, args.split_sentences)
        if texts is None:
            bad.append((kind, f"{path}:{first_line + i}"))
        else:
            parsed.append((first_line + i, texts))
    flat_ids = iter(_tokenize_all(tokenizer, [t for _, texts in parsed for key in keys for t in texts[key]]))
    eod = np.array([tokenizer.eod] if args.append_eod else [], dtype=np.int64)
    # Per key: id arrays to concatenate, sequence lengths [sequences], sequences per doc [docs].
    per_key: dict[str, tuple[list, list, list]] = {key: ([], [], []) for key in keys}
    docs = 0
    for line_no, texts in parsed:
        encoded = {key: [next(flat_ids) for _ in texts[key]] for key in keys}
        if any(ids is None for pieces in encoded.values() for ids in pieces):
            bad.append(("tokenizer_error", f"{path}:{line_no}"))
            continue
        encoded = {key: [ids for ids in pieces if len(ids)] for key, pieces in encoded.items()}
        if any(not pieces for pieces in encoded.values()):
            bad.append(("empty_text", f"{path}:{line_no}"))
            continue
        docs += 1
        for key, pieces in encoded.items():
            chunks, lengths, per_doc = per_key[key]
            chunks += pieces
            lengths += map(len, pieces)
            if eod.size:  # a shared [eod] chunk: appending to the last piece would copy it
                chunks.append(eod)
                lengths[-1] += 1
            per_doc.append(len(pieces))
    out = {key: _pack(*lists, dtype) for key, lists in per_key.items()}
    nbytes = sum(map(len, lines)) + len(lines)  # the line ends count as one byte each
    return bad, out, docs, nbytes


def _pack(chunks: list[np.ndarray], lengths: list[int], per_doc: list[int], dtype) -> tuple[np.ndarray, ...]:
    """Return (tokens [sum(lengths)] of ``dtype``: the chunks back to back, lengths, per_doc) as arrays.

    Arrays, not lists, go back to the main process: a numpy array pickles as one buffer. The lengths and
    sequences per document are int64. An id that ``dtype`` cannot hold raises OverflowError.
    """
    if not chunks:
        return np.zeros(0, dtype), np.zeros(0, np.int64), np.zeros(0, np.int64)
    ids = np.concatenate(chunks)
    info = np.iinfo(dtype)
    if ids.min() < info.min or ids.max() > info.max:
        raise OverflowError(f"a token id is out of the {np.dtype(dtype).name} range of the dataset")
    return ids.astype(dtype, copy=False), np.asarray(lengths, dtype=np.int64), np.asarray(per_doc, dtype=np.int64)


# ---------------------------------------------------------------------------------------------------
# Main side: read, dispatch, write in order.


def _line_blocks(path: str, start: int, end: int | None, first_line: int, batch_lines: int):
    """Yield (number of the first line, raw bytes of up to ``batch_lines`` whole lines) of one shard.

    The lines are those ``_common.iter_lines(path, start, end, first_line)`` yields (a line that starts
    before ``end`` is read whole), but read ``batch_lines`` at a time in C (``islice`` over the file, one
    join) instead of one Python step per line: the main process only moves bytes.
    """
    with _common.open_binary(path) as f:
        if start:
            f.seek(start)
        position, line_no = start, first_line
        while True:
            lines = list(itertools.islice(f, batch_lines))
            last = len(lines) < batch_lines  # end of file
            if end is not None:  # keep the lines that start before `end`
                starts = list(itertools.accumulate(map(len, lines), initial=position))
                kept = bisect.bisect_left(starts, end, hi=len(lines))
                last = last or kept < len(lines)
                lines = lines[:kept]
            if lines:
                blob = b"".join(lines)
                yield line_no, blob
                position += len(blob)
                line_no += len(lines)
            if last:
                return


def _batches(shards: list[tuple[str, int, int | None, int]], batch_lines: int):
    """Yield ``encode_batch`` tasks (file, first line number, raw lines) over the shards in order."""
    for path, start, end, first_line in shards:
        for line_no, blob in _line_blocks(path, start, end, first_line, batch_lines):
            yield path, line_no, blob


def _ordered_results(args: argparse.Namespace, shards, workers: int):
    """Yield encode_batch results in input order, with at most 2 * workers batches in flight."""
    batches = _batches(shards, args.batch_lines)
    yield from _common.ordered_map(encode_batch, batches, workers, _init_pool_worker, (args,))


def _init_pool_worker(args: argparse.Namespace) -> None:
    """Pool initializer: reuse the state ``run_partition`` set up in this process or, forked, in the parent.

    Building a GPT-2 tokenizer costs ~0.1 s (vocabulary json, merges, tiktoken ranks): as much as
    tokenizing a few MB, so it is built once per run, not once more per worker.
    """
    if _worker.get("args") != args:  # a spawned worker starts empty
        _init_worker(args)


def output_prefixes(args: argparse.Namespace) -> dict[str, str]:
    """Return the output prefix of each json key: ``<output-prefix>_<key>_{document|sentence}``."""
    level = "sentence" if args.split_sentences else "document"
    return {key: f"{args.output_prefix}_{key}_{level}" for key in args.json_keys}


def run_partition(args: argparse.Namespace, shards, prefixes: dict[str, str], workers: int, label: str = "") -> Stats:
    """Binarize ``shards`` into datasets at ``prefixes``; return the counts (nothing written if no docs)."""
    _init_worker(args)  # fails here, before any output, when the tokenizer files are unreadable
    builders = {key: IndexedDatasetBuilder(prefix, _worker["dtype"]) for key, prefix in prefixes.items()}
    stats = Stats()
    progress = _common.Progress(args.log_interval, label)
    try:
        for bad, out, docs, nbytes in _ordered_results(args, shards, workers):
            for kind, where in bad:
                stats.add_bad(kind, where)
            tokens = 0
            for key, (ids, sequence_lengths, sequences_per_doc) in out.items():
                builders[key].add_documents(ids, sequence_lengths, sequences_per_doc)
                tokens += int(ids.size)
            stats.docs += docs
            stats.lines += docs + len(bad)
            stats.tokens += tokens
            stats.bytes += nbytes
            progress.update(docs, nbytes, tokens)
        if stats.docs == 0:
            raise RuntimeError("no good document in the input")
        for builder in builders.values():
            builder.finalize()
    except BaseException:
        for builder in builders.values():
            builder.abort()
        raise
    return stats


def _plan_partitions(files: list[str], partitions: int) -> list[list[tuple[str, int, int | None, int]]]:
    """Return ``partitions`` lists of shards (file, start byte, end byte, first line number), in order."""
    if partitions <= 1:
        return [[(f, 0, None, 1) for f in files]]
    shards = []
    per_file = max(1, -(-partitions // len(files)))
    for path in files:
        size = os.path.getsize(path)
        if path.endswith(".gz") or per_file == 1 or size == 0:
            shards.append((path, 0, None, 1))
            continue
        cuts, line_no = [0], [1]
        with open(path, "rb") as f:  # move each cut to the next line start, counting lines on the way
            position, lines = 0, 0
            for k in range(1, per_file):
                target = size * k // per_file
                if target <= cuts[-1]:
                    continue
                while position < target:
                    chunk = f.read(min(1 << 20, target - position))
                    lines += chunk.count(b"\n")
                    position += len(chunk)
                rest = f.readline()
                position += len(rest)
                lines += rest.count(b"\n")
                if position >= size:
                    break
                cuts.append(position)
                line_no.append(lines + 1)
        bounds = cuts + [None]
        shards += [(path, cuts[i], bounds[i + 1], line_no[i]) for i in range(len(cuts))]
    groups: list[list] = [[] for _ in range(min(partitions, len(shards)))]
    for i, shard in enumerate(shards):  # contiguous blocks keep the input order across partitions
        groups[i * len(groups) // len(shards)].append(shard)
    return groups


def _partition_main(args, shards, prefixes, workers, label, queue) -> None:
    try:
        queue.put(("ok", run_partition(args, shards, prefixes, workers, label)))
    except BaseException as exc:  # reported by the parent
        queue.put(("error", f"{type(exc).__name__}: {exc}"))


def run(args: argparse.Namespace) -> Stats:
    """Binarize the input into ``output_prefixes(args)``; return the counts."""
    files = _common.resolve_inputs(args.input)
    prefixes = output_prefixes(args)
    groups = _plan_partitions(files, args.partitions)
    if len(groups) == 1:
        return run_partition(args, groups[0], prefixes, args.workers)
    workers = max(1, args.workers // len(groups))
    tag = f"part{os.getpid()}"
    part_prefixes = [{k: f"{p}.{tag}-{i}" for k, p in prefixes.items()} for i in range(len(groups))]
    ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    queues = [ctx.Queue() for _ in groups]
    procs = [
        ctx.Process(target=_partition_main, args=(args, g, part_prefixes[i], workers, f"[partition {i}] ", queues[i]))
        for i, g in enumerate(groups)
    ]
    for p in procs:
        p.start()
    results = [q.get() for q in queues]
    for p in procs:
        p.join()
    stats = Stats()
    try:
        errors = [msg for status, msg in results if status == "error"]
        if errors and not all("no good document" in e for e in errors):
            raise RuntimeError(f"a partition failed: {errors[0]}")
        good = [i for i, (status, _) in enumerate(results) if status == "ok"]
        if not good:
            raise RuntimeError("no good document in the input")
        for _, partial in (results[i] for i in good):
            stats.merge(partial)
        dtype = best_fitting_dtype(_build_tokenizer(args).vocab_size)
        for key, prefix in prefixes.items():
            with IndexedDatasetBuilder(prefix, dtype) as builder:
                for i in good:
                    builder.add_index(part_prefixes[i][key])
    finally:
        for parts in part_prefixes:
            for prefix in parts.values():
                for ext in (".bin", ".idx"):
                    if os.path.exists(prefix + ext):
                        os.remove(prefix + ext)
    return stats


def report(stats: Stats, prefixes: dict[str, str], elapsed: float, stream=sys.stderr) -> None:
    """Print the summary: documents, tokens, rates, bad lines by kind with their first line numbers."""
    print(
        f"done: {stats.docs} documents, {stats.tokens} tokens, {stats.bytes / 1e6:.2f} MB in {elapsed:.1f} s "
        f"({stats.docs / elapsed:.1f} docs/s, {stats.bytes / elapsed / 1e6:.2f} MB/s, "
        f"{stats.tokens / elapsed:.0f} tokens/s)",
        file=stream,
    )
    for prefix in prefixes.values():
        print(f"wrote {prefix}.bin and {prefix}.idx", file=stream)
    if stats.bad:
        total = sum(stats.bad.values())
        print(f"skipped {total} bad lines:", file=stream)
        for kind in BAD_KINDS:
            if stats.bad.get(kind):
                print(f"  {kind}: {stats.bad[kind]} (first at {', '.join(stats.first_bad[kind])})", file=stream)


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Return the parsed command line (Megatron's preprocess_data.py flags)."""
    parser = QuietArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True, help="jsonl(.gz) file, directory of them, or glob")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="keys of the text fields to binarize")
    group.add_argument("--split-sentences", action="store_true", help="one sequence per sentence")
    group = parser.add_argument_group("tokenizer")
    group.add_argument(
        "--tokenizer-type",
        default="GPT2BPETokenizer",
        choices=["GPT2BPETokenizer", "HuggingFaceTokenizer", "NullTokenizer", "PurePythonGPT2BPETokenizer"],
        help="PurePythonGPT2BPETokenizer is the slow reference engine (benchmarks)",
    )
    group.add_argument("--vocab-file", default=None, help="GPT-2 encoder.json/vocab.json (default: GPT-2's)")
    group.add_argument("--merge-file", default=None, help="GPT-2 vocab.bpe/merges.txt (default: GPT-2's)")
    group.add_argument("--tokenizer-model", default=None, help="tokenizer.json for HuggingFaceTokenizer")
    group.add_argument("--vocab-size", type=int, default=None, help="vocabulary of the NullTokenizer")
    group.add_argument("--append-eod", action="store_true", help="append the end-of-document token")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True, help="writes <prefix>_<key>_document.{bin,idx}")
    group.add_argument("--dataset-impl", default="mmap", choices=["mmap"], help="only mmap (Megatron's)")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    group.add_argument("--partitions", type=int, default=1, help="input parts processed concurrently, then merged")
    group.add_argument("--log-interval", type=int, default=10000, help="documents between progress lines")
    group.add_argument("--batch-lines", type=int, default=256, help="lines per task sent to a worker")
    args = parser.parse_args(argv)
    for flag, value in (
        ("--workers", args.workers),
        ("--partitions", args.partitions),
        ("--batch-lines", args.batch_lines),
    ):
        if value < 1:
            parser.error(f"{flag} {value} must be >= 1")
    if args.tokenizer_type == "HuggingFaceTokenizer" and not args.tokenizer_model:
        parser.error("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model")
    if args.tokenizer_type == "NullTokenizer" and not args.vocab_size:
        parser.error("--tokenizer-type NullTokenizer needs --vocab-size")
    return args


def main(argv: list[str] | None = None) -> int:
    args = get_args(argv)
    # One thread per worker process: --workers is the parallelism the user asked for.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    start = time.perf_counter()
    try:
        stats = run(args)
    except KeyboardInterrupt:
        print("interrupted: no output written", file=sys.stderr)
        return 130
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    report(stats, output_prefixes(args), max(time.perf_counter() - start, 1e-9))
    return 0


if __name__ == "__main__":
    sys.exit(main())
