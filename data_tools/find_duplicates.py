"""Find near-duplicate documents with MinHash and LSH banding; write the similar pairs as jsonl.

    python data_tools/find_duplicates.py --input corpus.jsonl --output pairs.jsonl --threshold 0.8

Each document becomes a set of shingles (``--shingle char``: lowercased character ``--ngram``-grams with
whitespace collapsed, default 5; ``word``: word n-grams, default 3). Its MinHash signature holds
``--num-perm`` minima of universal hash functions over the 32-bit shingle hashes (``MinHasher``);
two signatures agree in each position with probability equal to the sets' Jaccard similarity.
LSH splits the signature into b bands of r rows (chosen to minimize the false positive and false
negative areas around ``--threshold``); documents sharing any band become candidates, and a candidate
pair is reported when its estimated Jaccard is at least the threshold. Output lines:
``{"a": id, "b": id, "jaccard": 0.93}``. Ids are ``--id-key`` values, or else the line number (from 0,
over all input files in order). Then ``group_duplicates.py`` and ``remove_duplicates.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
import zlib
from collections import defaultdict

import _common
import numpy as np

from megatron_like.config import QuietArgumentParser


def _area(y: np.ndarray, x: np.ndarray) -> float:
    """Trapezoid-rule integral of ``y`` over ``x`` (numpy 2 renamed np.trapz to np.trapezoid: this works on both)."""
    return float(np.sum((y[1:] + y[:-1]) * np.diff(x)) / 2)


def lsh_params(threshold: float, num_perm: int, fp_weight: float = 0.5) -> tuple[int, int]:
    """Return (bands, rows) with bands * rows <= num_perm minimizing weighted false positive/negative areas.

    A pair of similarity s becomes a candidate with probability ``1 - (1 - s^r)^b``.
    """
    grid = np.linspace(0.0, 1.0, 201)
    best, best_cost = (1, num_perm), float("inf")
    for b in range(1, num_perm + 1):
        for r in range(1, num_perm // b + 1):
            p = 1.0 - (1.0 - grid**r) ** b
            fp = _area(np.where(grid < threshold, p, 0.0), grid)
            fn = _area(np.where(grid >= threshold, 1.0 - p, 0.0), grid)
            cost = fp_weight * fp + (1 - fp_weight) * fn
            if cost < best_cost:
                best, best_cost = (b, r), cost
    return best


def shingle_hashes(text: str, kind: str, ngram: int) -> np.ndarray:
    """Return uint64 [k]: distinct 32-bit hashes of the document's shingles (at least one)."""
    if kind == "char":
        text = " ".join(text.lower().split())
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.uint64)
    else:
        codes = np.array([zlib.crc32(w.encode("utf-8")) for w in text.lower().split()], dtype=np.uint64)
    if codes.size == 0:
        return np.zeros(1, dtype=np.uint64)
    n = min(ngram, codes.size)
    with np.errstate(over="ignore"):  # polynomial rolling hash, wrapping mod 2^64 on purpose
        h = np.zeros(codes.size - n + 1, dtype=np.uint64)
        for j in range(n):
            h = h * np.uint64(1000003) + codes[j : codes.size - n + 1 + j]
        h ^= h >> np.uint64(31)
        h *= np.uint64(0x9E3779B97F4A7C15)
        h ^= h >> np.uint64(29)
    return np.unique(h >> np.uint64(32))


class MinHasher:
    """MinHash signatures of ``num_perm`` hash functions drawn from a seeded RNG.

    Function k is Dietzfelbinger's multiply-shift ``((a_k * h + b_k) mod 2^64) >> 32`` (a_k odd, 64-bit
    a_k and b_k): strongly universal on 32-bit keys ``h``, and native uint64 arithmetic computes it.
    """

    def __init__(self, num_perm: int, seed: int) -> None:
        rng = np.random.RandomState(seed)
        words = rng.randint(0, 1 << 32, size=(4, num_perm, 1), dtype=np.int64).astype(np.uint64)
        self.a = (words[0] << np.uint64(32)) | words[1] | np.uint64(1)
        self.b = (words[2] << np.uint64(32)) | words[3]

    def signature(self, hashes: np.ndarray, block: int = 4096) -> np.ndarray:
        """Return uint32 [num_perm]: for each function, its minimum over ``hashes`` (uint64 [k], < 2^32)."""
        sig = np.full(self.a.shape[0], np.iinfo(np.uint64).max, dtype=np.uint64)
        with np.errstate(over="ignore"):  # wrapping mod 2^64 is the hash
            for start in range(0, hashes.size, block):
                h = hashes[None, start : start + block]
                sig = np.minimum(sig, ((self.a * h + self.b) >> np.uint64(32)).min(axis=1))
        return sig.astype(np.uint32)


def find_pairs(signatures: np.ndarray, bands: int, rows: int, threshold: float, max_bucket: int = 50):
    """Yield (i, j, estimated jaccard) for candidate pairs i < j at or above ``threshold``.

    ``signatures`` is uint32 [n, num_perm]. In a bucket larger than ``max_bucket`` each member is
    compared with the first one only (enough to group them, without quadratic blow-up).
    """
    seen: set[tuple[int, int]] = set()
    for band in range(bands):
        buckets: dict[bytes, list[int]] = defaultdict(list)
        part = np.ascontiguousarray(signatures[:, band * rows : (band + 1) * rows])
        for i in range(part.shape[0]):
            buckets[part[i].tobytes()].append(i)
        for members in buckets.values():
            if len(members) < 2:
                continue
            if len(members) <= max_bucket:
                pairs = [(x, y) for k, x in enumerate(members) for y in members[k + 1 :]]
            else:
                pairs = [(members[0], y) for y in members[1:]]
            for pair in pairs:
                if pair in seen:
                    continue
                seen.add(pair)
                jaccard = float(np.mean(signatures[pair[0]] == signatures[pair[1]]))
                if jaccard >= threshold:
                    yield pair[0], pair[1], jaccard


_state: dict = {}


def _init(args: argparse.Namespace) -> None:
    _state["args"] = args
    _state["hasher"] = MinHasher(args.num_perm, args.seed)


def _sign_batch(batch: list[tuple[int, bytes]]) -> list[tuple[int, str | None, np.ndarray | None]]:
    args, hasher = _state["args"], _state["hasher"]
    out = []
    for ordinal, raw in batch:
        try:
            obj = json.loads(raw)
            text = obj[args.text_key]
            if not isinstance(text, str):
                raise TypeError
            doc_id = str(obj[args.id_key]) if args.id_key else str(ordinal)
        except (ValueError, KeyError, TypeError, RecursionError):
            out.append((ordinal, None, None))
            continue
        out.append((ordinal, doc_id, hasher.signature(shingle_hashes(text, args.shingle, args.ngram))))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = QuietArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, help="jsonl(.gz) file, directory or glob")
    parser.add_argument("--output", required=True, help="pairs jsonl")
    parser.add_argument("--text-key", default="text")
    parser.add_argument("--id-key", default=None, help="field naming a document (default: its line number)")
    parser.add_argument("--shingle", choices=["char", "word"], default="char")
    parser.add_argument("--ngram", type=int, default=None, help="shingle length (default 5 chars, 3 words)")
    parser.add_argument("--num-perm", type=int, default=128)
    parser.add_argument("--threshold", type=float, default=0.8, help="Jaccard similarity of a duplicate")
    parser.add_argument("--bands", type=int, default=None, help="override the LSH bands (rows follow)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--log-interval", type=int, default=10000)
    args = parser.parse_args(argv)
    if not 0 < args.threshold <= 1:
        parser.error(f"--threshold {args.threshold} must be in (0, 1]")
    args.ngram = args.ngram or (5 if args.shingle == "char" else 3)
    if args.bands:
        bands, rows = args.bands, args.num_perm // args.bands
    else:
        bands, rows = lsh_params(args.threshold, args.num_perm)
    files = _common.input_files_or_exit(args.input)
    ids: list[str] = []
    signatures: list[np.ndarray] = []
    unreadable = 0
    progress = _common.Progress(args.log_interval, "signatures: ")
    lines = ((k, raw) for k, (_, _, raw) in enumerate(_common.iter_json_docs(files)) if raw.strip())
    for results in _common.ordered_map(_sign_batch, _common.batched(lines, 256), args.workers, _init, (args,)):
        for _, doc_id, sig in results:
            if sig is None:
                unreadable += 1
            else:
                ids.append(doc_id)
                signatures.append(sig)
        progress.update(len(results), 0)
    matrix = np.stack(signatures) if signatures else np.zeros((0, args.num_perm), np.uint32)
    count = 0
    with _common.open_text_out(args.output) as out:
        for i, j, jaccard in find_pairs(matrix, bands, rows, args.threshold):
            out.write(json.dumps({"a": ids[i], "b": ids[j], "jaccard": round(jaccard, 4)}) + "\n")
            count += 1
    print(
        f"{len(ids)} documents ({unreadable} unreadable skipped), LSH {bands} bands x {rows} rows: "
        f"{count} pairs with Jaccard >= {args.threshold} -> {args.output}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
