"""A plain single-file PyTorch sequence-classification fine-tune: the reference our fine-tune is checked against.

The network is ``benchmarks/plain_gpt.py``'s GPT (dropout on the embeddings, the attention probabilities and
each residual branch, as ours) with the head of ``megatron_like/model/classification.py``: a bias-free
``h -> num_classes`` linear on the final hidden state of each sequence's last real token. The recipe is
``finetune_gpt_classification.py``'s defaults: AdamW (betas 0.9 / 0.999, eps 1e-8) with weight decay on every
matrix and none on vectors, gradient clipping at ``--clip-grad``, a linear warmup over the first
``--lr-warmup-fraction`` of the iterations then linear decay to ``--min-lr`` (Megatron's rule: iteration k uses
the lr of step k - 1), ``--epochs`` passes over the training set, the micro batches of a global batch averaged.

It starts from the same numbers as ours: the GPT body from ``--pretrained-checkpoint`` (a ``pretrain_gpt.py
--save`` checkpoint, read by our loader) and the head our ``GPTClassificationModel`` draws for ``--seed``
(``--own-head-init`` draws it here instead, N(0, 0.02^2)). It reads the samples ours reads: the same
tokenization of the same files (``SentencePairDataset``) in the same seeded epoch order (``EpochDataset``),
so only the model code, the update, the dropout masks and float rounding differ. At the end the whole dev
set is evaluated once and printed in our format::

    .venv/bin/python benchmarks/plain_gpt_classification.py --pretrained-checkpoint CKPT \\
        --train-data data/docstring_classes/train.jsonl --valid-data data/docstring_classes/dev.jsonl \\
        --num-classes 8 --vocab-file runs/demo/tokenizer/vocab.json --merge-file runs/demo/tokenizer/merges.txt

``benchmarks/learning_quality.py finetune`` runs it next to ``finetune_gpt_classification.py``.
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

sys.path.insert(0, str(Path(__file__).parent))  # benchmarks/ is not a package: plain_gpt.py beside this file

import plain_gpt  # noqa: E402


class PlainGPTClassifier(nn.Module):
    """token ids ``[b, s]`` and last real positions ``[b]`` -> class logits ``[b, num_classes]``."""

    def __init__(self, vocab: int, positions: int, num_layers: int, hidden: int, heads: int, num_classes: int,
                 hidden_dropout: float = 0.1, attention_dropout: float = 0.1, std: float = 0.02) -> None:
        super().__init__()
        self.gpt = plain_gpt.PlainGPT(vocab, positions, num_layers, hidden, heads, std, hidden_dropout,
                                      attention_dropout)
        self.head = nn.Linear(hidden, num_classes, bias=False)
        nn.init.normal_(self.head.weight, 0.0, std)

    def forward(self, ids: torch.Tensor, last_index: torch.Tensor) -> torch.Tensor:
        hidden = self.gpt.hidden(ids)  # (b, s, h)
        pooled = hidden[torch.arange(ids.shape[0], device=ids.device), last_index]  # (b, h): last real token
        return self.head(pooled)


@torch.no_grad()
def copy_weights(model: PlainGPTClassifier, ours: nn.Module) -> None:
    """Give ``model`` the weights of our single-process ``GPTClassificationModel`` ``ours`` (same numbers)."""
    plain_gpt.copy_weights(model.gpt, ours)  # ours has GPT's embedding, layers and final_layernorm names
    model.head.weight.copy_(ours.head_weight)


def our_initial_model(args: argparse.Namespace, vocab: int) -> nn.Module:
    """Our single-process ``GPTClassificationModel`` for ``--seed``, its body loaded from the checkpoint."""
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


def batch(samples, first: int, size: int) -> dict[str, torch.Tensor]:
    """Samples ``[first, first + size)`` stacked: tokens ``[b, s]``, last_index ``[b]``, label ``[b]``."""
    rows = [samples[i] for i in range(first, first + size)]
    return {key: torch.stack([torch.as_tensor(row[key]) for row in rows]) for key in ("tokens", "last_index", "label")}


@torch.no_grad()
def evaluate(model: PlainGPTClassifier, dataset, micro_batch_size: int) -> dict[str, float]:
    """Accuracy and mean loss over all of ``dataset``, in eval mode (no dropout)."""
    model.eval()
    correct, loss_sum = 0, 0.0
    for first in range(0, len(dataset), micro_batch_size):
        b = batch(dataset, first, min(micro_batch_size, len(dataset) - first))
        logits = model(b["tokens"], b["last_index"]).float()
        correct += int((logits.argmax(-1) == b["label"]).sum())
        loss_sum += F.cross_entropy(logits, b["label"], reduction="sum").item()
    model.train()
    return {"accuracy": correct / len(dataset), "loss": loss_sum / len(dataset), "samples": len(dataset)}


def train(args: argparse.Namespace) -> dict[str, float]:
    """Fine-tune, then evaluate the whole dev set; return its metrics."""
    from megatron_like.data.classification_dataset import EpochDataset, SentencePairDataset
    from megatron_like.data.tokenizer import build_tokenizer

    tokenizer = build_tokenizer("GPT2BPETokenizer", args.vocab_file, args.merge_file, None, None)
    divisor = args.make_vocab_size_divisible_by
    vocab = math.ceil(tokenizer.vocab_size / divisor) * divisor
    make = functools.partial(SentencePairDataset, tokenize=tokenizer.tokenize, seq_length=args.seq_length,
                             sep_id=tokenizer.eod, pad_id=tokenizer.eod, num_classes=args.num_classes)
    train_set, dev = make(args.train_data), make(args.valid_data)
    gbs, mbs = args.global_batch_size, args.micro_batch_size
    train_iters = max(1, math.ceil(args.epochs * len(train_set) / gbs))
    samples = EpochDataset(train_set, train_iters * gbs, args.seed)  # ours: the same seeded epoch order
    schedule = argparse.Namespace(lr=args.lr, min_lr=args.min_lr, train_iters=train_iters, lr_decay_style="linear",
                                  lr_warmup_iters=int(args.lr_warmup_fraction * train_iters))
    print(f" > fine-tuning on {len(train_set)} examples for {train_iters} iterations of {gbs}; lr {args.lr:.3E}",
          flush=True)

    torch.manual_seed(args.seed)
    model = PlainGPTClassifier(vocab, args.max_position_embeddings, args.num_layers, args.hidden_size,
                               args.num_attention_heads, args.num_classes, args.hidden_dropout,
                               args.attention_dropout)
    ours = our_initial_model(args, vocab)
    if args.own_head_init:
        head = model.head.weight.detach().clone()
        copy_weights(model, ours)
        model.head.weight.data.copy_(head)
    else:
        copy_weights(model, ours)
    del ours
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim == 1]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=0.0,
                                  betas=(0.9, 0.999), eps=1e-8)
    steps = gbs // mbs
    for iteration in range(1, train_iters + 1):
        for group in optimizer.param_groups:
            group["lr"] = plain_gpt.lr_at(iteration - 1, schedule)
        optimizer.zero_grad(set_to_none=True)
        loss_sum, correct = 0.0, 0
        for micro in range(steps):
            b = batch(samples, (iteration - 1) * gbs + micro * mbs, mbs)
            logits = model(b["tokens"], b["last_index"])
            loss = F.cross_entropy(logits.float(), b["label"])
            (loss / steps).backward()
            loss_sum += loss.item() / steps
            correct += int((logits.argmax(-1) == b["label"]).sum())
        nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
        optimizer.step()
        if iteration % args.log_interval == 0:
            print(f" iteration {iteration:4d}/{train_iters:4d} | loss: {loss_sum:.6E} | accuracy: "
                  f"{correct / gbs:.4f} |", flush=True)
    metrics = evaluate(model, dev, mbs)
    print(f" dev set: {metrics['samples']} examples | accuracy: {100 * metrics['accuracy']:.2f} | "
          f"loss: {metrics['loss']:.6E} |", flush=True)
    return metrics


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags of finetune_gpt_classification.py that this recipe uses, under the same names."""
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
    parser.add_argument("--hidden-dropout", type=float, default=0.1)
    parser.add_argument("--attention-dropout", type=float, default=0.1)
    parser.add_argument("--epochs", type=float, default=3.0)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--min-lr", type=float, default=0.0)
    parser.add_argument("--lr-warmup-fraction", type=float, default=0.1)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--clip-grad", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--own-head-init", action="store_true",
                        help="draw the head here (N(0, 0.02^2)) instead of copying the one ours draws for --seed")
    args = parser.parse_args(argv)
    if args.global_batch_size % args.micro_batch_size:
        parser.error(f"--global-batch-size {args.global_batch_size} must be a multiple of --micro-batch-size "
                     f"{args.micro_batch_size}")
    return args


if __name__ == "__main__":
    train(parse_args())
