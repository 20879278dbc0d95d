"""Zero-shot evaluation of a checkpoint (Megatron's ``tasks/main.py --task WIKITEXT103|LAMBADA``).

    python tools/evaluate.py --load ckpt --task WIKITEXT103 --valid-data wiki.test.txt --overlapping-eval 32
    torchrun --nproc_per_node=2 tools/evaluate.py --load ckpt --tensor-model-parallel-size 2 \\
        --task LAMBADA --valid-data lambada_test.jsonl --strict-lambada
    torchrun --nproc_per_node=8 tools/evaluate.py --load ckpt --tensor-model-parallel-size 2 ...  # 4 replicas

Processes beyond one tp x pp model replica form data-parallel replicas, which split the batches.

``WIKITEXT103`` (alias ``perplexity``): the file (``.txt`` as one text, ``.jsonl`` as documents with a
``text`` field joined by end-of-text) is tokenized as one stream and scored with windows of
``--eval-seq-length`` (default: the checkpoint's ``--seq-length``) that advance by
``--overlapping-eval`` tokens, each target scored once. Prints Megatron's line with the token perplexity
and the word-adjusted one (``exp(total loss / (words - 1))``, words = space-separated pieces).
``LAMBADA`` (alias ``lambada``): jsonl of ``{"text": ...}``; an example is right when greedy decoding,
teacher forced, predicts its last token (or, with ``--strict-lambada``, every token of its last word).
A checkpoint without a tokenizer reads texts as space-separated token ids.

``--harness-url`` instead runs EleutherAI's lm-evaluation-harness (``local-completions``) against a running
``tools/text_generation_server.py`` (``megatron_like/inference/harness.py``) and prints its table:

    python tools/evaluate.py --harness-url http://127.0.0.1:5000 --harness-tasks my_task \\
        --harness-include-path tasks/ --harness-max-length 1024 [--harness-output results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_like.config import ConfigError  # noqa: E402
from megatron_like.inference import cli  # noqa: E402
from megatron_like.inference.evaluation import (  # noqa: E402
    lambada_accuracy,
    lambada_example,
    perplexity,
    sliding_windows,
)

TASKS = {"WIKITEXT103": "WIKITEXT103", "perplexity": "WIKITEXT103", "LAMBADA": "LAMBADA", "lambada": "LAMBADA"}


class IdsTokenizer:
    """Texts of space-separated ids, for checkpoints trained on mock data."""

    eod = None

    def tokenize(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]


def read_documents(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        if not path.endswith((".jsonl", ".json")):
            return [f.read()]
        docs = []
        for n, line in enumerate(f, 1):
            if line.strip():
                record = json.loads(line)
                if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                    raise ValueError(f"{path}:{n}: each line must be a JSON object with a 'text' string")
                docs.append(record["text"])
        return docs


def build_parser():
    parser = cli.inference_parser("Zero-shot evaluation: sliding-window perplexity or LAMBADA accuracy")
    g = parser.add_argument_group("evaluation")
    g.add_argument("--task", required=True, choices=sorted(TASKS), help="What to evaluate.")
    g.add_argument("--valid-data", required=True, help="Text/jsonl file (perplexity) or jsonl (LAMBADA).")
    g.add_argument("--overlapping-eval", type=int, default=32, help="Window stride of the perplexity eval.")
    g.add_argument("--eval-seq-length", type=int, default=None, help="Window length (default: --seq-length).")
    g.add_argument("--strict-lambada", action="store_true", help="Score every token of the last word.")
    return parser


def harness_main(argv: list[str]) -> None:
    """``--harness-url``: evaluate the server there with lm-evaluation-harness tasks."""
    from megatron_like.inference.harness import evaluate_server

    parser = argparse.ArgumentParser(description="lm-evaluation-harness against tools/text_generation_server.py")
    parser.add_argument("--harness-url", required=True, help="The server, e.g. http://127.0.0.1:5000.")
    parser.add_argument("--harness-tasks", required=True, help="Comma-separated harness task names.")
    parser.add_argument("--harness-include-path", default=None, help="A directory of task YAML files.")
    parser.add_argument("--harness-max-length", type=int, default=2048,
                        help="Context + continuation tokens at most (the model's positions).")
    parser.add_argument("--harness-limit", type=int, default=None, help="Examples per task at most.")
    parser.add_argument("--harness-concurrency", type=int, default=4, help="Requests in flight (batched by the "
                        "server).")
    parser.add_argument("--harness-output", default=None, help="Write the results (samples included) as JSON here.")
    args = parser.parse_args(argv)
    if args.harness_include_path and not os.path.isdir(args.harness_include_path):
        parser.error(f"--harness-include-path {args.harness_include_path} is not a directory")
    results = evaluate_server(args.harness_url, [t for t in args.harness_tasks.split(",") if t],
                              args.harness_max_length, args.harness_include_path, args.harness_limit,
                              args.harness_concurrency)
    from lm_eval.utils import make_table

    print(make_table(results), flush=True)
    if args.harness_output:
        with open(args.harness_output, "w") as f:
            json.dump(results, f, indent=2, default=str)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if any(a.split("=")[0] == "--harness-url" for a in argv):
        return harness_main(argv)
    args, config = cli.parse(build_parser(), argv)
    try:
        ps = cli.setup(config, data_parallel=True)  # replicas split the batches
        loaded = cli.load(config, ps, args.iteration)
        tokenizer = loaded.tokenizer or IdsTokenizer()
        docs = read_documents(args.valid_data)
        if not docs:
            raise ValueError(f"--valid-data {args.valid_data} holds no text")
    except (ConfigError, ValueError, OSError, RuntimeError) as error:
        cli.fail(str(error))
    task, chunk = TASKS[args.task], loaded.model[0]
    batch = config.training.micro_batch_size
    show = ps.rank == 0

    def bar(batches: int):
        """Progress over the batches of rank 0's replica (replica 0 takes every dp-th, the first included)."""
        if not show:
            return None
        from tqdm import tqdm

        return iter(tqdm(range(-(-batches // ps.expert_dp_size)), desc=task, unit="batch", file=sys.stderr))

    try:
        if task == "WIKITEXT103":
            tokens: list[int] = []
            for i, doc in enumerate(docs):
                if i and tokenizer.eod is not None:
                    tokens.append(tokenizer.eod)
                tokens.extend(tokenizer.tokenize(doc))
            num_words = sum(len(doc.strip().split(" ")) for doc in docs)
            seq = args.eval_seq_length or loaded.config.model.seq_length
            seq = min(seq, loaded.config.model.max_positions)
            stride = min(args.overlapping_eval, seq)
            windows = len(sliding_windows(len(tokens), seq, stride))
            result = perplexity(chunk, tokens, num_words, seq, stride, loaded.vocab_size, batch,
                                bar(-(-windows // batch)))
            if show:
                print(result.line(task), flush=True)
        else:
            examples = [lambada_example(tokenizer, doc, args.strict_lambada) for doc in docs]
            progress = bar(-(-len(examples) // batch))
            accuracy, count = lambada_accuracy(chunk, examples, loaded.vocab_size, batch, progress)
            if show:
                print(f" validation results on {task} | number correct: {round(accuracy * count)} | total: {count} | "
                      f"accuracy: {accuracy:.4f} |", flush=True)
    except ValueError as error:
        cli.fail(str(error))
    finally:
        ps.destroy()


if __name__ == "__main__":
    main()
