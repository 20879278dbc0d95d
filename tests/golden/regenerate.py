"""Rewrite the golden loss curves (``tests/golden/*.json``) from the current code.

    PYTHONPATH=. .venv/bin/python -m tests.golden.regenerate [mock] [text]

Run it only after a change that is meant to move every run's losses (initialization, data order, lr
schedule, loss), and commit the new files with that change. It prints the old and new curves.
"""

from __future__ import annotations

import json
import sys

import torch

from tests.golden.runs import RUNS, golden_path


def main(names: list[str]) -> None:
    torch.set_num_threads(1)
    for name in names or list(RUNS):
        curves = RUNS[name]()
        path = golden_path(name)
        old = json.loads(path.read_text()) if path.exists() else None
        record = {
            "regenerate": "PYTHONPATH=. .venv/bin/python -m tests.golden.regenerate " + name,
            "torch": torch.__version__,
            **curves,
        }
        path.write_text(json.dumps(record, indent=1) + "\n")
        print(f"{name}: {path}")
        for key, values in curves.items():
            print(f"  {key}: {values}" + (f"\n   was: {old.get(key)}" if old else ""))


if __name__ == "__main__":
    main(sys.argv[1:])
