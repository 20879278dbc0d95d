"""Generate text from a checkpoint (any training layout) in one process or under torchrun.

    python tools/generate.py --load ckpt --prompt "The history of" --max-new-tokens 40 --greedy
    torchrun --nproc_per_node=2 tools/generate.py --load ckpt --tensor-model-parallel-size 2 \\
        --prompt "The history of" --top-p 0.9 --temperature 0.8 --seed 1
    python tools/generate.py --load mock_ckpt --prompt-ids "1 2 3" --max-new-tokens 8 --greedy --json

Prompts come from ``--prompt`` (repeatable), ``--prompt-ids`` (space-separated token ids, repeatable)
or ``--prompts-file`` (one prompt per line, or jsonl with a ``prompt`` or ``text`` field). A mock-data
checkpoint has no tokenizer: its prompts (``--prompt-ids`` or the file's) are token ids and the output
is ids. The tokenizer is the checkpoint's unless ``--tokenizer-type`` (with ``--vocab-file/--merge-file``
or ``--tokenizer-model``) is given.
Output: per prompt and returned sequence, the prompt and its continuation as text, or with ``--json``
one JSON object per line: ``prompt``, ``text`` (the continuation), ``token_ids`` (the generated ids
only, ending with end-of-text when generation stopped there), ``sequence`` and ``score``. Sampling uses
``--seed``. Prompts are generated ``--micro-batch-size`` at a time.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_like.config import ConfigError  # noqa: E402
from megatron_like.inference import cli  # noqa: E402
from megatron_like.inference.generation import GenerationParams, generate  # noqa: E402
from megatron_like.inference.packed_linear import ensure_packed  # noqa: E402


def build_parser():
    parser = cli.inference_parser("Generate text from a GPT checkpoint (greedy, sampling, beam search)")
    g = parser.add_argument_group("generation")
    g.add_argument("--prompt", action="append", default=[], help="A text prompt (repeatable).")
    g.add_argument("--prompt-ids", action="append", default=[], help="A prompt of space-separated token ids.")
    g.add_argument("--prompts-file", help="One prompt per line, or jsonl with a 'prompt' or 'text' field.")
    g.add_argument("--max-new-tokens", type=int, default=32, help="Tokens to generate at most.")
    g.add_argument("--min-new-tokens", type=int, default=0, help="No end-of-text before this many tokens.")
    g.add_argument("--greedy", action="store_true", help="Take the most likely token (no sampling).")
    g.add_argument("--temperature", type=float, default=1.0, help="Sampling temperature.")
    g.add_argument("--top-k", type=int, default=0, help="Sample among the k most likely tokens (0 = off).")
    g.add_argument("--top-p", type=float, default=1.0, help="Nucleus sampling threshold (1.0 = off).")
    g.add_argument("--num-return-sequences", type=int, default=1, help="Sequences per prompt.")
    g.add_argument("--num-beams", type=int, default=1, help="Beam search with this many beams (> 1).")
    g.add_argument("--length-penalty", type=float, default=1.0, help="Beam score = logprob / length ** this.")
    g.add_argument("--early-stopping", choices=["true", "false", "never"], default="false",
                   help="Beam search stopping rule (Hugging Face's).")
    g.add_argument("--no-kv-cache", action="store_true", help="Recompute every position each step (slow).")
    g.add_argument("--no-weight-prepacking", action="store_true",
                   help="Multiply with F.linear instead of weights prepacked for the batch (saves one weight copy).")
    g.add_argument("--json", action="store_true", help="Print one JSON object per generated sequence.")
    g.add_argument("--output", help="Write the output to this file instead of stdout.")
    parser.set_defaults(**{"training.micro_batch_size": 8})
    return parser


def read_prompts(args, tokenizer) -> tuple[list[str], list[list[int]]]:
    """(display strings, token ids) of every prompt, in the order given."""
    texts: list[str] = list(args.prompt)
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            for line in f:
                line = line.rstrip("\n")
                if not line.strip():
                    continue
                if line.lstrip().startswith("{"):
                    record = json.loads(line)
                    line = record.get("prompt", record.get("text"))
                    if not isinstance(line, str):
                        raise ValueError(f"{args.prompts_file}: a jsonl line needs a 'prompt' or 'text' string")
                texts.append(line)
    if args.prompt and tokenizer is None:
        raise ValueError("this checkpoint has no tokenizer (mock data): pass --prompt-ids '1 2 3' or "
                         "--tokenizer-type with its files")
    from_file = texts[len(args.prompt):]
    if tokenizer is not None:
        ids = [tokenizer.tokenize(t) for t in texts]
    else:  # without a tokenizer, the file's prompts are token ids too
        texts, ids = [], []
    for raw in (from_file if tokenizer is None else []) + list(args.prompt_ids):
        try:
            ids.append([int(x) for x in raw.replace(",", " ").split()])
        except ValueError:
            raise ValueError(f"prompt {raw!r} must be space-separated token ids (no tokenizer)") from None
        texts.append(raw)
    if not ids:
        raise ValueError("no prompt: pass --prompt, --prompt-ids or --prompts-file")
    return texts, ids


def params_of(args, seed: int) -> GenerationParams:
    early = {"true": True, "false": False, "never": "never"}[args.early_stopping]
    return GenerationParams(
        max_new_tokens=args.max_new_tokens, min_new_tokens=args.min_new_tokens,
        do_sample=not args.greedy and args.num_beams == 1, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, num_return_sequences=args.num_return_sequences, num_beams=args.num_beams,
        length_penalty=args.length_penalty, early_stopping=early, seed=seed, use_cache=not args.no_kv_cache,
    ).validate()


def main(argv: list[str] | None = None) -> None:
    args, config = cli.parse(build_parser(), argv)
    try:
        ps = cli.setup(config)
        loaded = cli.load(config, ps, args.iteration)
        texts, prompts = read_prompts(args, loaded.tokenizer)
        params = params_of(args, config.training.seed)
    except (ConfigError, ValueError, FileNotFoundError, RuntimeError) as error:
        cli.fail(str(error))
    tokenizer, is_printer = loaded.tokenizer, ps.rank == 0
    out = open(args.output, "w", encoding="utf-8") if args.output and is_printer else sys.stdout  # noqa: SIM115
    batch_size = config.training.micro_batch_size
    starts = range(0, len(prompts), batch_size)
    if is_printer and len(starts) > 1:
        from tqdm import tqdm

        starts = tqdm(starts, desc="generating", unit="batch", file=sys.stderr)
    try:
        for start in starts:
            batch = prompts[start:start + batch_size]
            if not args.no_weight_prepacking:
                ensure_packed(loaded.model, len(batch) * max(params.num_beams, params.num_return_sequences))
            try:
                results = generate(loaded.model, batch, params, eod=loaded.eod, vocab_size=loaded.vocab_size)
            except ValueError as error:
                cli.fail(str(error))
            if not is_printer:
                continue
            for i, sequences in enumerate(results):
                for j, seq in enumerate(sequences):
                    ids = seq.token_ids
                    shown = [t for t in ids if t != loaded.eod]
                    text = tokenizer.detokenize(shown) if tokenizer is not None else " ".join(map(str, shown))
                    if args.json:
                        record = {"prompt": texts[start + i], "text": text, "token_ids": ids, "sequence": j,
                                  "score": seq.score}
                        print(json.dumps(record, ensure_ascii=False), file=out, flush=True)
                    else:
                        header = f"--- prompt {start + i}" + (f", sequence {j}" if len(sequences) > 1 else "")
                        joiner = "" if tokenizer is not None else " -> "
                        print(f"{header} ---\n{texts[start + i]}{joiner}{text}", file=out, flush=True)
    finally:
        if out is not sys.stdout:
            out.close()
        ps.destroy()


if __name__ == "__main__":
    main()
