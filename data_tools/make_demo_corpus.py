"""Write a jsonl corpus of real English: the docstrings of the Python standard library.

    python data_tools/make_demo_corpus.py --output data/demo/corpus.jsonl --max-mb 4

Every fresh machine has it. The standard library's sources are parsed with ``ast`` (nothing is
imported or run), files in sorted order; each module, class or function docstring of at least
``--min-chars`` characters becomes one document ``{"text": ..., "source": "json/decoder.py:JSONDecoder"}``.
Output is deterministic for a given Python version and stops at ``--max-mb`` megabytes.
"""

from __future__ import annotations

import ast
import json
import os
import sys
import sysconfig
from collections.abc import Iterator

from megatron_like.config import QuietArgumentParser

SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "lib2to3"}


def stdlib_files(root: str) -> Iterator[str]:
    """Yield the .py files under ``root`` in sorted order, skipping tests and installed packages."""
    for current, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("."))
        for name in sorted(files):
            if name.endswith(".py"):
                yield os.path.join(current, name)


def docstrings(path: str, root: str) -> Iterator[tuple[str, str]]:
    """Yield (source label, docstring) of the module and its classes and functions, in source order."""
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), filename=path)
    except (SyntaxError, ValueError, OSError):
        return
    rel = os.path.relpath(path, root).replace(os.sep, "/")
    stack: list[tuple[ast.AST, str]] = [(tree, "")]
    while stack:
        node, qualname = stack.pop(0)
        doc = ast.get_docstring(node, clean=True)
        if doc:
            yield (f"{rel}:{qualname}" if qualname else rel), doc
        children = [
            (child, f"{qualname}.{child.name}" if qualname else child.name)
            for child in ast.iter_child_nodes(node)
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        ]
        stack[0:0] = children


def main(argv: list[str] | None = None) -> int:
    parser = QuietArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="jsonl file to write")
    parser.add_argument("--max-mb", type=float, default=4.0, help="stop after this many megabytes")
    parser.add_argument("--min-chars", type=int, default=200, help="shortest docstring kept")
    parser.add_argument("--stdlib", default=sysconfig.get_paths()["stdlib"], help="standard library dir")
    args = parser.parse_args(argv)
    limit = int(args.max_mb * 1e6)
    written = docs = 0
    os.makedirs(os.path.dirname(os.path.abspath(args.output)) or ".", exist_ok=True)
    tmp = f"{args.output}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as out:
        for path in stdlib_files(args.stdlib):
            for source, doc in docstrings(path, args.stdlib):
                if len(doc) < args.min_chars:
                    continue
                line = json.dumps({"text": doc, "source": source}, ensure_ascii=False) + "\n"
                if written + len(line.encode("utf-8")) > limit:
                    break
                out.write(line)
                written += len(line.encode("utf-8"))
                docs += 1
            else:
                continue
            break
    os.replace(tmp, args.output)
    print(
        f"wrote {docs} documents, {written / 1e6:.2f} MB of standard-library docstrings -> {args.output}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
