"""Concatenate Megatron mmap datasets into one (``<output-prefix>.bin/.idx``), in the order given.

    python data_tools/merge_datasets.py --input data/parts --output-prefix data/all_text_document
    python data_tools/merge_datasets.py --input data/a_text_document data/b_text_document --output-prefix out

``--input`` takes dataset prefixes, or one directory whose ``*.idx`` datasets are merged in sorted name
order. All inputs must share a dtype. The output is written under temporary names and renamed.
Exit status: 0 merged, 1 on a missing, corrupt or mismatched input (nothing written), 2 usage error.
"""

from __future__ import annotations

import os
import sys

import _common  # noqa: F401 - puts the repo on sys.path when run from a checkout

from megatron_like.config import QuietArgumentParser
from megatron_like.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, IndexedDatasetError


def input_prefixes(inputs: list[str]) -> list[str]:
    """Return the dataset prefixes named by ``--input`` (a directory expands to its datasets, sorted)."""
    if len(inputs) == 1 and os.path.isdir(inputs[0]):
        names = sorted(n[: -len(".idx")] for n in os.listdir(inputs[0]) if n.endswith(".idx"))
        if not names:
            raise FileNotFoundError(f"--input {inputs[0]}: no .idx files in the directory")
        return [os.path.join(inputs[0], n) for n in names]
    return [p[: -len(".idx")] if p.endswith((".idx", ".bin")) else p for p in inputs]


def merge(prefixes: list[str], output_prefix: str) -> tuple[int, int]:
    """Write the concatenation of ``prefixes`` to ``output_prefix``; return (documents, tokens)."""
    first = IndexedDataset(prefixes[0])
    for prefix in prefixes[1:]:
        IndexedDataset(prefix)  # validate every input before writing anything
    with IndexedDatasetBuilder(output_prefix, first.dtype) as builder:
        for prefix in prefixes:
            builder.add_index(prefix)
    merged = IndexedDataset(output_prefix)
    return merged.num_documents, merged.num_tokens


def main(argv: list[str] | None = None) -> int:
    parser = QuietArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", required=True, help="dataset prefixes or one directory")
    parser.add_argument("--output-prefix", required=True, help="writes <output-prefix>.bin and .idx")
    args = parser.parse_args(argv)
    try:
        prefixes = input_prefixes(args.input)
        if os.path.abspath(args.output_prefix) in {os.path.abspath(p) for p in prefixes}:
            raise ValueError(f"--output-prefix {args.output_prefix} is also an input")
        docs, tokens = merge(prefixes, args.output_prefix)
    except (OSError, ValueError, IndexedDatasetError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(
        f"merged {len(prefixes)} datasets: {docs} documents, {tokens} tokens -> {args.output_prefix}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
