"""Write a real labeled text set, offline: standard-library docstrings labeled by the package they document.

    python data_tools/make_docstring_classes.py --output-dir data/docstring_classes --num-classes 8

Every machine has the Python standard library, and each docstring in it documents a module of a known
package: real English (written by people, about real code) with a real label. The classes are the
``--num-classes`` packages (directories of the standard library: ``asyncio``, ``email``, ``tkinter``...)
holding the most docstrings of at least ``--min-chars`` characters; the task is "which package does this
docstring document?". Docstrings are read with ``ast`` as ``make_demo_corpus.py`` reads them (nothing is
imported or run) and their whitespace is collapsed.

The split is by source file, seeded: each package's files are shuffled with ``--seed`` and files go to dev
until it holds ``--dev-fraction`` of that package's docstrings, so dev docstrings come from files the
fine-tune never saw (docstrings of one file share names and phrasing). Each class is capped at
``--max-per-class`` training examples, so the classes are close to balanced. Output, in the format
``finetune_gpt_classification.py`` reads (one text: ``sentence2`` is empty, the sample is ``tokens + [eod]``)::

    <output-dir>/train.jsonl, dev.jsonl   {"sentence1": docstring, "sentence2": "", "label": k, "source": ...}
    <output-dir>/classes.txt              package of label k on line k

Deterministic for a given Python version and ``--seed``. Caveat: the demo GPT (``scripts/demo.sh``) is
pretrained on these docstrings, so a model fine-tuned from it has read the dev texts (not their labels).
"""

from __future__ import annotations

import json
import os
import random
import re
import sys
import sysconfig
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_demo_corpus import docstrings, stdlib_files  # noqa: E402

from megatron_like.config import QuietArgumentParser  # noqa: E402


def package_docstrings(root: str, min_chars: int) -> dict[str, dict[str, list[str]]]:
    """``{package: {source file: [docstring, ...]}}`` of the packages (directories) under ``root``."""
    found: dict[str, dict[str, list[str]]] = defaultdict(dict)
    for path in stdlib_files(root):
        rel = os.path.relpath(path, root).replace(os.sep, "/")
        if "/" not in rel:  # a single-file module, not a package
            continue
        texts = [" ".join(doc.split()) for _, doc in docstrings(path, root)]
        texts = [t for t in texts if len(t) >= min_chars]
        if texts:
            found[rel.split("/", 1)[0]][rel] = texts
    return found


def split_files(files: dict[str, list[str]], dev_fraction: float, rng: random.Random) -> tuple[list[str], list[str]]:
    """(train files, dev files) of one package: shuffled, dev filled up to ``dev_fraction`` of its docstrings."""
    order = sorted(files)
    rng.shuffle(order)
    total, dev, dev_count = sum(len(v) for v in files.values()), [], 0
    for name in order:
        if dev_count >= dev_fraction * total or len(dev) == len(order) - 1:
            break
        dev.append(name)
        dev_count += len(files[name])
    return [name for name in order if name not in dev], dev


def main(argv: list[str] | None = None) -> int:
    parser = QuietArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--num-classes", type=int, default=8, help="the packages with the most docstrings")
    parser.add_argument("--min-chars", type=int, default=80, help="shortest docstring kept")
    parser.add_argument("--max-chars", type=int, default=600, help="docstrings are cut to this many characters")
    parser.add_argument("--dev-fraction", type=float, default=0.2)
    parser.add_argument("--max-per-class", type=int, default=400, help="training examples kept per class")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--stdlib", default=sysconfig.get_paths()["stdlib"], help="standard library dir")
    args = parser.parse_args(argv)
    if args.num_classes < 2 or not 0 < args.dev_fraction < 1:
        parser.error("--num-classes must be >= 2 and --dev-fraction in (0, 1)")
    found = package_docstrings(args.stdlib, args.min_chars)
    ranked = sorted(found, key=lambda p: (-sum(len(v) for v in found[p].values()), p))
    classes = [p for p in ranked if len(found[p]) >= 2][: args.num_classes]  # a package split needs 2 files
    if len(classes) < args.num_classes:
        parser.error(f"only {len(classes)} packages of >= 2 files have docstrings of >= {args.min_chars} chars")
    rng = random.Random(args.seed)
    splits: dict[str, list[dict]] = {"train": [], "dev": []}
    for label, package in enumerate(classes):
        train_files, dev_files = split_files(found[package], args.dev_fraction, rng)
        for split, names in (("train", train_files), ("dev", dev_files)):
            examples = [{"sentence1": re.sub(r"\s+", " ", text)[: args.max_chars], "sentence2": "", "label": label,
                         "source": name} for name in names for text in found[package][name]]
            if split == "train" and len(examples) > args.max_per_class:
                examples = rng.sample(examples, args.max_per_class)
            splits[split].extend(examples)
    os.makedirs(args.output_dir, exist_ok=True)
    for split, examples in splits.items():
        rng.shuffle(examples)
        with open(os.path.join(args.output_dir, f"{split}.jsonl"), "w", encoding="utf-8") as out:
            out.writelines(json.dumps(e, ensure_ascii=False) + "\n" for e in examples)
    with open(os.path.join(args.output_dir, "classes.txt"), "w", encoding="utf-8") as out:
        out.writelines(f"{package}\n" for package in classes)
    print(f"wrote {len(splits['train'])} train / {len(splits['dev'])} dev docstrings of {len(classes)} packages "
          f"({', '.join(classes)}) to {args.output_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
