"""Write the corpus without duplicates: of each group (``group_duplicates.py``) keep the first to appear.

    python data_tools/remove_duplicates.py --input corpus.jsonl --groups groups.jsonl --output dedup.jsonl

Ids must be the ones ``find_duplicates.py`` used: the same ``--id-key``, or (without it) the line
number from 0 over the same input files in the same order.
"""

from __future__ import annotations

import json
import sys

import _common

from megatron_like.config import QuietArgumentParser


def main(argv: list[str] | None = None) -> int:
    parser = QuietArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, help="the corpus given to find_duplicates.py")
    parser.add_argument("--groups", required=True, help="groups jsonl from group_duplicates.py")
    parser.add_argument("--output", required=True)
    parser.add_argument("--id-key", default=None, help="as given to find_duplicates.py")
    args = parser.parse_args(argv)
    try:
        files = _common.resolve_inputs(args.input)
        group_of: dict[str, int] = {}
        with open(args.groups, encoding="utf-8") as f:
            for g, line in enumerate(f):
                if line.strip():
                    for member in json.loads(line)["group"]:
                        group_of[str(member)] = g
    except (OSError, ValueError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    kept_groups: set[int] = set()
    kept = removed = 0
    with _common.open_text_out(args.output) as out:
        for ordinal, (_, _, raw) in enumerate(_common.iter_json_docs(files)):
            if not raw.strip():
                continue
            doc_id = str(ordinal)
            if args.id_key:
                try:
                    doc_id = str(json.loads(raw)[args.id_key])
                except (ValueError, KeyError, TypeError):
                    doc_id = None
            group = group_of.get(doc_id)
            if group is not None:
                if group in kept_groups:
                    removed += 1
                    continue
                kept_groups.add(group)
            out.write(raw.decode("utf-8", errors="replace") + "\n")
            kept += 1
    print(f"kept {kept} documents, removed {removed} duplicates -> {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
