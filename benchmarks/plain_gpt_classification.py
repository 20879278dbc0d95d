"""A plain single-file PyTorch sequence-classification fine-tune from PyTorch's defaults: the reference ours is
checked against.

What it shares with ours is what a fine-tune starts from and reads: the GPT body of ``--pretrained-checkpoint``
(a ``pretrain_gpt.py --save`` checkpoint, read by our loader into ``benchmarks/plain_gpt.py``'s plain GPT, with
dropout 0.1 where ours has it), the tokenized examples (``SentencePairDataset``: the same tokens, cut to
``--seq-length``, classified at the last real token), the number of iterations (``--epochs`` of global batches),
lr with 10% warmup then linear decay to 0, and the whole-dev-set accuracy at the end. Everything else is
PyTorch's default, not ours:

- the head is ``nn.Linear(h, num_classes)`` with its default initialization and bias (ours: bias-free, drawn at
  std 0.02);
- ``torch.optim.AdamW`` with its defaults (weight decay 0.01 on every parameter; ours: matrices only), no
  gradient clipping (ours: 1.0), ``LambdaLR`` for the schedule;
- a ``DataLoader`` reshuffling the training set every epoch from ``torch.manual_seed(--seed)`` (ours: its own
  seeded epoch order), the whole global batch in one step (ours: micro batches).

At the end the whole dev set is evaluated once and printed in our format::

    .venv/bin/python benchmarks/plain_gpt_classification.py --pretrained-checkpoint CKPT \\
        --train-data data/docstring_classes/train.jsonl --valid-data data/docstring_classes/dev.jsonl \\
        --num-classes 8 --vocab-file runs/demo/tokenizer/vocab.json --merge-file runs/demo/tokenizer/merges.txt

``benchmarks/learning_quality.py finetune`` runs it next to ``finetune_gpt_classification.py``.

``--as-ours CHOICE ...`` swaps single choices for ours, to find which of them moves the dev accuracy (issue 32
item 4): ``head`` (our bias-free head, drawn by our model from ``--seed``), ``decay`` (matrices only), ``clip``
(1.0), ``schedule`` (Megatron's: lr 0 at the first step, ``s / warmup`` then linear to 0), ``order`` (our
``EpochDataset`` sample order). Without it the script is PyTorch's defaults as listed above.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).parent))  # benchmarks/ is not a package: plain_gpt.py beside this file

import plain_gpt  # noqa: E402
from plain_vit import warmup_then_linear_decay  # noqa: E402


class PlainGPTClassifier(nn.Module):
    """token ids ``[b, s]`` and last real positions ``[b]`` -> class logits ``[b, num_classes]``."""

    def __init__(self, vocab: int, positions: int, num_layers: int, hidden: int, heads: int, num_classes: int,
                 hidden_dropout: float = 0.1, attention_dropout: float = 0.1) -> None:
        super().__init__()
        self.gpt = plain_gpt.PlainGPT(vocab, positions, num_layers, hidden, heads, 0.02, hidden_dropout,
                                      attention_dropout)
        self.head = nn.Linear(hidden, num_classes)  # PyTorch's default initialization and bias

    def forward(self, ids: torch.Tensor, last_index: torch.Tensor) -> torch.Tensor:
        hidden = self.gpt.hidden(ids)  # (b, s, h)
        pooled = hidden[torch.arange(ids.shape[0], device=ids.device), last_index]  # (b, h): last real token
        return self.head(pooled)


def pretrained_body(args: argparse.Namespace, vocab: int) -> nn.Module:
    """Our single-process ``GPTModel``-shaped classifier holding the checkpoint's body (read by our loader)."""
    from megatron_like.config import ModelConfig
    from megatron_like.model.classification import GPTClassificationModel, load_pretrained_gpt
    from megatron_like.parallel_state import ParallelState

    config = ModelConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                         num_attention_heads=args.num_attention_heads, seq_length=args.seq_length,
                         max_position_embeddings=args.max_position_embeddings)
    ours = GPTClassificationModel(config, ParallelState.single_process(), vocab_size=vocab,
                                  num_classes=args.num_classes, seed=args.seed)
    if args.pretrained_checkpoint:
        load_pretrained_gpt(ours, args.pretrained_checkpoint)
    return ours


AS_OURS = ("head", "decay", "clip", "schedule", "order")
"""The choices ``--as-ours`` can swap for ours, one at a time or together."""


def megatron_schedule(warmup: int, total: int):
    """``LambdaLR`` factor of step ``s`` (0-based) in our (Megatron's) schedule: ``s / warmup`` up to 1 (so the
    first step moves nothing), then linear to 0 at ``total``."""
    return lambda s: s / warmup if warmup > 0 and s <= warmup else max(0.0, (total - s) / max(1, total - warmup))


def our_batches(train_set: TensorDataset, batch_size: int, train_iters: int, seed: int) -> list[list[int]]:
    """The training-set indices of each global batch in our order (``EpochDataset``, as our fine-tune reads)."""
    from megatron_like.data.classification_dataset import EpochDataset

    order = EpochDataset(range(len(train_set)), train_iters * batch_size, seed)
    return [[order[i * batch_size + j] for j in range(batch_size)] for i in range(train_iters)]


def tensors(dataset) -> TensorDataset:
    """A ``SentencePairDataset`` as tensors: tokens ``[n, s]``, last_index ``[n]``, label ``[n]``."""
    return TensorDataset(*(torch.stack([torch.as_tensor(row[key]) for row in dataset.samples])
                           for key in ("tokens", "last_index", "label")))


@torch.no_grad()
def evaluate(model: PlainGPTClassifier, dataset: TensorDataset, batch_size: int) -> dict[str, float]:
    """Accuracy and mean loss over all of ``dataset``, in eval mode (no dropout).

    The global RNG is left as it was (a ``DataLoader`` draws a seed from it), so evaluating during training
    (``--eval-interval``) does not change the training's masks and order.
    """
    model.eval()
    correct, loss_sum = 0, 0.0
    with torch.random.fork_rng(devices=[]):
        for tokens, last_index, label in DataLoader(dataset, batch_size=batch_size):
            logits = model(tokens, last_index).float()
            correct += int((logits.argmax(-1) == label).sum())
            loss_sum += F.cross_entropy(logits, label, reduction="sum").item()
    model.train()
    return {"accuracy": correct / len(dataset), "loss": loss_sum / len(dataset), "samples": len(dataset)}


def train(args: argparse.Namespace) -> dict[str, float]:
    """Fine-tune, then evaluate the whole dev set; return its metrics."""
    from megatron_like.data.classification_dataset import SentencePairDataset
    from megatron_like.data.tokenizer import build_tokenizer

    tokenizer = build_tokenizer("GPT2BPETokenizer", args.vocab_file, args.merge_file, None, None)
    divisor = args.make_vocab_size_divisible_by
    vocab = math.ceil(tokenizer.vocab_size / divisor) * divisor
    make = functools.partial(SentencePairDataset, tokenize=tokenizer.tokenize, seq_length=args.seq_length,
                             sep_id=tokenizer.eod, pad_id=tokenizer.eod, num_classes=args.num_classes)
    train_set, dev = tensors(make(args.train_data)), tensors(make(args.valid_data))
    train_iters = max(1, math.ceil(args.epochs * len(train_set) / args.batch_size))
    warmup = int(args.lr_warmup_fraction * train_iters)
    print(f" > fine-tuning on {len(train_set)} examples for {train_iters} iterations of {args.batch_size}; "
          f"lr {args.lr:.3E}", flush=True)

    torch.manual_seed(args.seed)
    ours = set(args.as_ours)
    model = PlainGPTClassifier(vocab, args.max_position_embeddings, args.num_layers, args.hidden_size,
                               args.num_attention_heads, args.num_classes, args.dropout, args.dropout)
    body = pretrained_body(args, vocab)
    plain_gpt.copy_weights(model.gpt, body)
    if "head" in ours:
        model.head = nn.Linear(args.hidden_size, args.num_classes, bias=False)
        with torch.no_grad():
            model.head.weight.copy_(body.head_weight)
    params = model.parameters()
    if "decay" in ours:
        params = [{"params": [p for p in model.parameters() if p.ndim > 1]},
                  {"params": [p for p in model.parameters() if p.ndim <= 1], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    factor = (megatron_schedule if "schedule" in ours else warmup_then_linear_decay)(warmup, train_iters)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    # drop_last: every iteration sees --batch-size examples, as ours does.
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True)
    if "order" in ours:
        loader = DataLoader(train_set, batch_sampler=our_batches(train_set, args.batch_size, train_iters, args.seed))
    iteration = 0
    while iteration < train_iters:
        for tokens, last_index, label in loader:
            logits = model(tokens, last_index)
            loss = F.cross_entropy(logits.float(), label)
            optimizer.zero_grad()
            loss.backward()
            if "clip" in ours:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            iteration += 1
            if iteration % args.log_interval == 0:
                accuracy = (logits.argmax(-1) == label).float().mean().item()
                print(f" iteration {iteration:4d}/{train_iters:4d} | loss: {loss.item():.6E} | accuracy: "
                      f"{accuracy:.4f} |", flush=True)
            if args.eval_interval and iteration % args.eval_interval == 0:
                metrics = evaluate(model, dev, args.batch_size)
                print(f" dev set at iteration {iteration}: {metrics['samples']} examples | accuracy: "
                      f"{100 * metrics['accuracy']:.2f} | loss: {metrics['loss']:.6E} |", flush=True)
            if iteration == train_iters:
                break
    metrics = evaluate(model, dev, args.batch_size)
    print(f" dev set: {metrics['samples']} examples | accuracy: {100 * metrics['accuracy']:.2f} | "
          f"loss: {metrics['loss']:.6E} |", flush=True)
    return metrics


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags of finetune_gpt_classification.py that this recipe uses, under the same names (dropout one flag)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pretrained-checkpoint", help="pretrain_gpt.py --save directory (else a random body)")
    parser.add_argument("--train-data", required=True)
    parser.add_argument("--valid-data", required=True)
    parser.add_argument("--num-classes", type=int, default=2)
    parser.add_argument("--vocab-file", required=True)
    parser.add_argument("--merge-file", required=True)
    parser.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--max-position-embeddings", type=int, default=128)
    parser.add_argument("--dropout", type=float, default=0.1, help="ours: --hidden-dropout, --attention-dropout")
    parser.add_argument("--epochs", type=float, default=3.0)
    parser.add_argument("--global-batch-size", "--batch-size", dest="batch_size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--lr-warmup-fraction", type=float, default=0.1)
    parser.add_argument("--weight-decay", type=float, default=0.01, help="AdamW's default, on every parameter")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--eval-interval", type=int, default=0,
                        help="evaluate the whole dev set every this many iterations (0: only at the end)")
    parser.add_argument("--as-ours", nargs="*", choices=AS_OURS, default=[],
                        help="swap these choices for ours (an ablation; default: none, PyTorch's defaults)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    train(parse_args())
