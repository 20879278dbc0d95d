"""Shuffle the lines of a jsonl corpus with a seed, in bounded memory.

    python data_tools/shuffle.py --input corpus.jsonl --output shuffled.jsonl --seed 1234

Two passes: each line goes to one of ``--buckets`` temporary files chosen at random, then each bucket
is shuffled in memory and appended to the output. Memory holds one bucket (about input / buckets).
"""

from __future__ import annotations

import os
import random
import sys
import tempfile

import _common

from megatron_like.config import QuietArgumentParser


def main(argv: list[str] | None = None) -> int:
    parser = QuietArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, help="jsonl(.gz) file, directory or glob")
    parser.add_argument("--output", required=True)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--buckets", type=int, default=16, help="temporary files (more = less memory)")
    args = parser.parse_args(argv)
    files = _common.input_files_or_exit(args.input)
    rng = random.Random(args.seed)
    lines = 0
    out_dir = os.path.dirname(os.path.abspath(args.output))
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".shuffle-") as tmp:
        paths = [os.path.join(tmp, f"{i}.jsonl") for i in range(args.buckets)]
        buckets = [open(p, "wb") for p in paths]  # noqa: SIM115 - closed below
        try:
            for _, _, raw in _common.iter_json_docs(files):
                if raw.strip():
                    buckets[rng.randrange(args.buckets)].write(raw + b"\n")
                    lines += 1
        finally:
            for f in buckets:
                f.close()
        with _common.open_text_out(args.output) as out:
            for path in paths:
                with open(path, "rb") as f:
                    chunk = f.read().splitlines()
                rng.shuffle(chunk)
                for raw in chunk:
                    out.write(raw.decode("utf-8", errors="replace") + "\n")
    print(f"shuffled {lines} lines -> {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
