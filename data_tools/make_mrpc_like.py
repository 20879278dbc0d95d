"""Write a small generated MRPC-style paraphrase dataset (train and dev, TSV or JSONL).

    python data_tools/make_mrpc_like.py --output-dir data/mrpc_like --train 2000 --dev 400 --format tsv

Each example is a pair of English sentences built from templates and a label: 1 when the second
sentence is a paraphrase of the first (synonyms swapped, clauses reordered), 0 when it changes the
meaning (a negation, another number, another actor). Every negative carries a word the first sentence
lacks and positives never do, so the classes are separable: a model that compares the two sentences
reaches high accuracy. Classes are balanced; output is deterministic for a given ``--seed``.
Columns: ``sentence1  sentence2  label`` (TSV with that header, or JSONL objects with those keys).

It also writes ``tokenizer.json``, a word-level Hugging Face tokenizer of the generated vocabulary (plus
``<|endoftext|>`` and ``[UNK]``): ``--tokenizer-type HuggingFaceTokenizer --tokenizer-model`` it for a tiny
vocabulary (fast CPU runs); GPT-2's BPE works on the same files.
"""

from __future__ import annotations

import json
import os
import random

from megatron_like.config import QuietArgumentParser

ACTORS = ["the company", "the committee", "the minister", "the bank", "the court", "the council", "the team",
          "the agency", "the union", "the hospital"]
OTHER_ACTORS = ["a rival firm", "the opposition", "an outside group", "the regulator", "a foreign partner"]
VERBS = [("said", "stated"), ("approved", "accepted"), ("reported", "announced"), ("rejected", "turned down"),
         ("expected", "anticipated"), ("confirmed", "verified")]
OBJECTS = [("the plan", "the proposal"), ("the deal", "the agreement"), ("the results", "the figures"),
           ("the budget", "the spending plan"), ("the changes", "the revisions"), ("the offer", "the bid")]
TIMES = [("on monday", "on monday"), ("last week", "a week ago"), ("this year", "in the current year"),
         ("in march", "in march"), ("on friday", "on friday")]
NUMBERS = ["two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "twelve"]
NEGATIONS = ["did not", "never", "refused to say it"]


def make_pair(rng: random.Random) -> tuple[str, str, int]:
    """One (sentence1, sentence2, label) example."""
    actor, (verb, verb_syn), (obj, obj_syn), (time, time_syn) = (
        rng.choice(ACTORS), rng.choice(VERBS), rng.choice(OBJECTS), rng.choice(TIMES))
    number = rng.choice(NUMBERS)
    first = f"{actor} {verb} {obj} with {number} votes {time} ."
    label = rng.randrange(2)
    if label == 1:
        if rng.random() < 0.5:
            second = f"{actor} {verb_syn} {obj_syn} with {number} votes {time_syn} ."
        else:
            second = f"{time_syn} , {actor} {verb_syn} {obj} with {number} votes ."
        return first, second, 1
    change = rng.randrange(3)
    if change == 0:
        second = f"{actor} {rng.choice(NEGATIONS)} {verb_syn.split()[0]} {obj_syn} {time_syn} ."
    elif change == 1:
        other = rng.choice([n for n in NUMBERS if n != number])
        second = f"{actor} {verb_syn} {obj_syn} with only {other} votes {time_syn} ."
    else:
        second = f"{rng.choice(OTHER_ACTORS)} , not {actor} , {verb_syn} {obj_syn} {time_syn} ."
    return first, second, 0


def generate(num_examples: int, seed: int) -> list[dict[str, object]]:
    """``num_examples`` examples ``{"sentence1", "sentence2", "label"}`` from ``seed``."""
    rng = random.Random(seed)
    return [dict(zip(("sentence1", "sentence2", "label"), make_pair(rng))) for _ in range(num_examples)]


def write(path: str, examples: list[dict[str, object]]) -> None:
    """Write ``examples`` as JSONL (``.jsonl``) or TSV with a ``sentence1 sentence2 label`` header."""
    with open(path, "w", encoding="utf-8") as f:
        if path.endswith(".jsonl"):
            for example in examples:
                f.write(json.dumps(example) + "\n")
            return
        f.write("sentence1\tsentence2\tlabel\n")
        for e in examples:
            f.write(f"{e['sentence1']}\t{e['sentence2']}\t{e['label']}\n")


def write_word_tokenizer(path: str, examples: list[dict[str, object]]) -> int:
    """Write a word-level ``tokenizer.json`` covering ``examples``; returns its vocabulary size."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    words = sorted({w for e in examples for key in ("sentence1", "sentence2") for w in str(e[key]).split()})
    vocab = {word: i for i, word in enumerate(["[UNK]", "<|endoftext|>", *words])}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    tokenizer.save(path)
    return len(vocab)


def main(argv: list[str] | None = None) -> None:
    parser = QuietArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", required=True, help="writes train.<fmt> and dev.<fmt> here")
    parser.add_argument("--train", type=int, default=2000, help="training examples")
    parser.add_argument("--dev", type=int, default=400, help="dev examples")
    parser.add_argument("--format", choices=["tsv", "jsonl"], default="tsv")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    os.makedirs(args.output_dir, exist_ok=True)
    everything = []
    for split, count, seed in (("train", args.train, args.seed), ("dev", args.dev, args.seed + 1)):
        path = os.path.join(args.output_dir, f"{split}.{args.format}")
        examples = generate(count, seed)
        write(path, examples)
        everything += examples
        print(f"wrote {count} examples to {path}")
    size = write_word_tokenizer(os.path.join(args.output_dir, "tokenizer.json"), everything)
    print(f"wrote a word-level tokenizer of {size} tokens to {os.path.join(args.output_dir, 'tokenizer.json')}")


if __name__ == "__main__":
    main()
