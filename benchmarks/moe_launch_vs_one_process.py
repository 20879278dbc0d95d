"""docs/moe.md's torchrun command at several layouts against ``python pretrain_gpt.py`` (one process): the largest
relative difference of each logged value (lm loss, grad norm, router losses) over the iterations.

    .venv/bin/python benchmarks/moe_launch_vs_one_process.py                  # mock data (the page's command)
    .venv/bin/python benchmarks/moe_launch_vs_one_process.py --data-path P    # a GPT-2-tokenized prefix P

Real launches (``torchrun --standalone``, fresh interpreters, ~30 s of CPU each), two sets: dropout off (the
command as documented) and dropout at its default 0.1 (the two dropout flags left out). With ``--data-path`` the
command reads ``P`` with GPT2BPETokenizer instead of ``--mock-data --vocab-size 512``, and each tp 2 layout runs
once more with ``--make-vocab-size-divisible-by`` halved (the one-process padding). Make ``P`` with
``data_tools/preprocess.py --input tests/data/docstrings.jsonl --output-prefix D --tokenizer-type
GPT2BPETokenizer --append-eod --workers 1`` (``P`` is then ``D_text_document``). Figures: docs/moe.md, Checking a
launch against one process. 0 means equal to the printed digits.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.e2e.cli import documented_launch, torchrun  # noqa: E402

EP2, TP2, SP = ["--expert-model-parallel-size", "2"], ["--tensor-model-parallel-size", "2"], ["--sequence-parallel"]
LAYOUTS: dict[str, tuple[int, list[str]]] = {  # each "ep 2" layout after its twin without ep
    "dp 2 (no ep)": (2, []),
    "tp 2 x dp 2 (no ep)": (4, TP2),
    "tp 2 x dp 2 + sp (no ep)": (4, TP2 + SP),
    "ep 2 (dp 2)": (2, EP2),
    "ep 2 x tp 2": (4, EP2 + TP2),
    "ep 2 x tp 2 + sp": (4, EP2 + TP2 + SP),
    "ep 2 x tp 2 + sp, etp 1": (4, EP2 + TP2 + SP + ["--expert-tensor-parallel-size", "1"]),
    "tp 2": (2, TP2),
    "tp 2 + sp": (2, TP2 + SP),
}
VALUE = re.compile(r"\| (lm loss|grad norm|load_balancing_loss|z_loss): ([0-9.E+-]+) ")


def logged(stdout: str) -> dict[int, dict[str, float]]:
    """``{iteration: {name: value}}`` of the training log lines."""
    rows = {}
    for line in stdout.splitlines():
        it = re.match(r"\s*iteration\s+(\d+)/", line)
        if it:
            rows[int(it.group(1))] = {name: float(v) for name, v in VALUE.findall(line)}
    return rows


def run(nproc: int, flags: list[str]) -> dict[int, dict[str, float]]:
    if nproc > 1:
        return logged(torchrun(nproc, flags, timeout=900))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "pretrain_gpt.py", *flags], cwd=ROOT, env=env, capture_output=True,
                          text=True, check=True, timeout=900)
    return logged(done.stdout)


def largest_differences(ref: dict, other: dict) -> dict[str, float]:
    assert sorted(ref) == sorted(other), (sorted(ref), sorted(other))
    out: dict[str, float] = {}
    for it, values in ref.items():
        for name, v in values.items():
            out[name] = max(out.get(name, 0.0), abs(other[it][name] - v) / abs(v))
    return out


def without(flags: list[str], *names: str) -> list[str]:
    """``flags`` without each ``--name value`` pair in ``names``."""
    out, skip = [], False
    for i, flag in enumerate(flags):
        if skip:
            skip = False
        elif flag in names:
            skip = i + 1 < len(flags) and not flags[i + 1].startswith("--")
        else:
            out.append(flag)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--data-path", help="a GPT-2-tokenized dataset prefix (default: mock data)")
    args = parser.parse_args()
    _, documented = documented_launch("moe.md")
    base = without(documented, *{f for f in EP2 + TP2 + SP if f.startswith("--")}, "--train-iters", "--eval-iters")
    base += ["--train-iters", str(args.iters), "--eval-iters", "0"]
    divisible = 128
    if args.data_path:
        base = without(base, "--mock-data", "--vocab-size") + [
            "--data-path", args.data_path, "--split", "98,2,0", "--tokenizer-type", "GPT2BPETokenizer",
            "--make-vocab-size-divisible-by", str(divisible)]
    names = ["lm loss", "grad norm", "load_balancing_loss", "z_loss"]
    print(f"{'dropout':8} {'layout':36} " + " ".join(f"{n:>20}" for n in names) + f"{'lm loss vs no ep':>20}")
    for dropout, flags in (("0", base), ("0.1", without(base, "--hidden-dropout", "--attention-dropout"))):
        reference = run(1, flags)
        rows = [(label, nproc, flags + layout) for label, (nproc, layout) in LAYOUTS.items()]
        if args.data_path:  # the tp 2 layouts again, padded as one process pads
            rows += [(f"{label}, pad as tp 1", nproc, without(flags, "--make-vocab-size-divisible-by") + layout + [
                "--make-vocab-size-divisible-by", str(divisible // 2)])
                for label, (nproc, layout) in LAYOUTS.items() if "tp 2" in label]
        results: dict[tuple[str, ...], dict] = {}  # by the run's flags
        for label, nproc, run_flags in rows:
            results[tuple(run_flags)] = values = run(nproc, run_flags)
            diff = largest_differences(reference, values)
            # the same layout without expert parallelism: what ep itself changes
            twin = results.get(tuple(without(run_flags, "--expert-model-parallel-size",
                                             "--expert-tensor-parallel-size")))
            vs_twin = largest_differences(twin, values)["lm loss"] if twin and "ep 2" in label else float("nan")
            print(f"{dropout:8} {label:36} " + " ".join(f"{diff.get(n, float('nan')):20.1e}" for n in names)
                  + f"{vs_twin:20.1e}", flush=True)


if __name__ == "__main__":
    main()
