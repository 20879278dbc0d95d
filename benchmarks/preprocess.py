"""Preprocessing throughput: our GPT-2 BPE (tiktoken, else Rust ``tokenizers``) vs the pure-Python GPT-2
BPE, and the time to build the GPT dataset indices of a large synthetic dataset (numpy fallback vs C++
helper).

    python benchmarks/preprocess.py                      # demo corpus x 2, workers 1 and 2
    python benchmarks/preprocess.py --copies 10 --workers 1 2 --index-tokens 1e9

The corpus is the standard-library docstring corpus (``data_tools/make_demo_corpus.py``) repeated
``--copies`` times. Both engines run the same ``data_tools/preprocess.py`` pipeline on the same corpus
and workers; only the tokenizer differs. Prints tables with ratios (fast / pure Python).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "data_tools")]

import make_demo_corpus  # noqa: E402
import preprocess  # noqa: E402

from megatron_like.data import index_helpers  # noqa: E402
from megatron_like.data.tokenizer import GPT2BPETokenizer  # noqa: E402

ENGINES = ("PurePythonGPT2BPETokenizer", "GPT2BPETokenizer")


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def make_corpus(directory: str, copies: int) -> str:
    """Return a jsonl path holding the demo corpus ``copies`` times."""
    single = os.path.join(directory, "single.jsonl")
    make_demo_corpus.main(["--output", single, "--max-mb", "100"])
    path = os.path.join(directory, "corpus.jsonl")
    with open(single, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        for _ in range(copies):
            f.write(data)
    return path


def time_preprocess(corpus: str, out_dir: str, tokenizer_type: str, workers: int) -> preprocess.Stats:
    prefix = os.path.join(out_dir, f"{tokenizer_type}-{workers}")
    args = preprocess.get_args(
        [
            "--input",
            corpus,
            "--output-prefix",
            prefix,
            "--tokenizer-type",
            tokenizer_type,
            "--append-eod",
            "--workers",
            str(workers),
            "--log-interval",
            str(10**9),
        ]
    )
    start = time.perf_counter()
    stats = preprocess.run(args)
    stats.elapsed = time.perf_counter() - start
    return stats


def bench_preprocess(copies: int, workers_list: list[int]) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with tempfile.TemporaryDirectory() as tmp:
        corpus = make_corpus(tmp, copies)
        size_mb = os.path.getsize(corpus) / 1e6
        print(f"\npreprocess: {size_mb:.1f} MB corpus (stdlib docstrings x {copies}), --append-eod, GPT-2 BPE")
        header = f"| {'engine':<28} | workers | {'docs/s':>9} | {'MB/s':>6} | {'tokens/s':>10} | ratio |"
        print(header)
        print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
        for workers in workers_list:
            slow = time_preprocess(corpus, tmp, "PurePythonGPT2BPETokenizer", workers)
            fast = time_preprocess(corpus, tmp, "GPT2BPETokenizer", workers)
            outputs = [os.path.join(tmp, f"{t}-{workers}_text_document.bin") for t in ENGINES]
            same = len({_read(p) for p in outputs}) == 1
            engine = GPT2BPETokenizer().engine
            for name, s in (("pure-Python GPT-2 BPE", slow), (f"ours ({engine})", fast)):
                t = s.elapsed
                print(
                    f"| {name:<28} | {workers:>7} | {s.docs / t:>9.0f} | {s.bytes / t / 1e6:>6.2f} "
                    f"| {s.tokens / t:>10.0f} | {slow.elapsed / t:>4.1f}x |"
                )
            print(f"  (workers {workers}: identical .bin from both engines: {same})")


def bench_indices(num_tokens: float, seq_length: int) -> None:
    rng = np.random.RandomState(0)
    mean_doc = 500
    num_docs = int(num_tokens // mean_doc)
    sizes = rng.randint(1, 2 * mean_doc, size=num_docs).astype(np.int32)
    tokens = int(sizes.sum(dtype=np.int64))
    samples = (tokens - 1) // seq_length
    print(f"\nGPT indices: {num_docs} documents, {tokens / 1e9:.2f} B tokens, seq {seq_length}, {samples} samples")
    print(f"| {'step':<34} | {'numpy (s)':>9} | {'C++ (s)':>8} | ratio |")
    print(f"|{'-' * 36}|{'-' * 11}|{'-' * 10}|-------|")
    start = time.perf_counter()
    doc_idx = index_helpers.build_doc_idx(np.arange(num_docs), 1, np.random.RandomState(1), False)
    t_doc = time.perf_counter() - start
    start = time.perf_counter()
    shuffle = index_helpers.build_shuffle_idx(samples, samples, np.random.RandomState(1))
    t_shuffle = time.perf_counter() - start
    del shuffle
    print(f"| {'doc_idx (numpy shuffle)':<34} | {t_doc:>9.2f} | {'-':>8} |   -   |")
    print(f"| {'shuffle_idx (numpy shuffle)':<34} | {t_shuffle:>9.2f} | {'-':>8} |   -   |")
    rows = []
    os.environ["MEGATRON_LIKE_NO_CSRC"] = "1"
    start = time.perf_counter()
    ref = index_helpers.build_sample_idx(sizes, doc_idx, seq_length, 1, tokens)
    rows.append(["sample_idx", time.perf_counter() - start])
    blend_size = min(samples, 2_000_000)
    start = time.perf_counter()
    ref_blend = index_helpers.build_blending_indices(np.array([0.3, 0.7]), blend_size)
    rows.append([f"blending ({blend_size} samples, 2 sets)", time.perf_counter() - start])
    del os.environ["MEGATRON_LIKE_NO_CSRC"]
    if index_helpers.csrc_helpers() is not None:
        start = time.perf_counter()
        got = index_helpers.build_sample_idx(sizes, doc_idx, seq_length, 1, tokens)
        rows[0].append(time.perf_counter() - start)
        assert np.array_equal(got, ref)
        start = time.perf_counter()
        got_blend = index_helpers.build_blending_indices(np.array([0.3, 0.7]), blend_size)
        rows[1].append(time.perf_counter() - start)
        assert np.array_equal(got_blend[0], ref_blend[0])
    for name, t_np, *t_c in rows:
        cpp = f"{t_c[0]:>8.2f}" if t_c else f"{'n/a':>8}"
        ratio = f"{t_np / t_c[0]:>4.1f}x" if t_c else "  -  "
        print(f"| {name:<34} | {t_np:>9.2f} | {cpp} | {ratio} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--copies", type=int, default=2, help="times the demo corpus is repeated")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--index-tokens", type=float, default=1e9, help="tokens of the synthetic dataset")
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--skip-indices", action="store_true")
    args = parser.parse_args()
    print(f"machine: {os.cpu_count()} CPUs, python {sys.version.split()[0]}, numpy {np.__version__}")
    bench_preprocess(args.copies, args.workers)
    if not args.skip_indices:
        bench_indices(args.index_tokens, args.seq_length)


if __name__ == "__main__":
    main()
