"""Group duplicate pairs (from ``find_duplicates.py``) into connected components.

    python data_tools/group_duplicates.py --input pairs.jsonl --output groups.jsonl [--threshold 0.9]

Output lines: ``{"group": [id, id, ...]}``, members in order of first appearance in the pairs; a
document similar to one that is similar to a third lands in one group with both (union-find).
"""

from __future__ import annotations

import json
import sys

import _common

from megatron_like.config import QuietArgumentParser


class UnionFind:
    """Disjoint sets over string ids with path halving and union by size."""

    def __init__(self) -> None:
        self.parent: dict[str, str] = {}
        self.size: dict[str, int] = {}

    def find(self, x: str) -> str:
        if x not in self.parent:
            self.parent[x], self.size[x] = x, 1
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a: str, b: str) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return
        if self.size[ra] < self.size[rb]:
            ra, rb = rb, ra
        self.parent[rb] = ra
        self.size[ra] += self.size[rb]


def main(argv: list[str] | None = None) -> int:
    parser = QuietArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, help="pairs jsonl from find_duplicates.py")
    parser.add_argument("--output", required=True, help="groups jsonl")
    parser.add_argument("--threshold", type=float, default=0.0, help="ignore pairs below this Jaccard")
    args = parser.parse_args(argv)
    files = _common.input_files_or_exit(args.input)
    sets = UnionFind()
    order: dict[str, int] = {}
    pairs = 0
    for path, line_no, raw in _common.iter_json_docs(files):
        if not raw.strip():
            continue
        try:
            pair = json.loads(raw)
            a, b, jaccard = str(pair["a"]), str(pair["b"]), float(pair.get("jaccard", 1.0))
        except (ValueError, KeyError, TypeError) as exc:
            print(f"error: {path}:{line_no}: not a pair line ({exc})", file=sys.stderr)
            return 1
        if jaccard < args.threshold:
            continue
        pairs += 1
        for x in (a, b):
            order.setdefault(x, len(order))
        sets.union(a, b)
    groups: dict[str, list[str]] = {}
    for x in sorted(order, key=order.__getitem__):
        groups.setdefault(sets.find(x), []).append(x)
    with _common.open_text_out(args.output) as out:
        for members in groups.values():
            out.write(json.dumps({"group": members}) + "\n")
    print(f"{pairs} pairs -> {len(groups)} groups of {len(order)} documents -> {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
