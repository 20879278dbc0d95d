"""A plain single-file PyTorch GPT-2 and its training loop: the reference our GPT's learning is checked against.

Same architecture as ``megatron_like/model``: learned token and position embeddings, pre-LN layers with
causal multi-head attention (fused QKV with bias) and a GELU (tanh) MLP of 4h, a final LayerNorm and an
output layer tied to the token embedding. Same initialization: every weight ~N(0, 0.02^2), the two output
projections of each layer ~N(0, (0.02 / sqrt(2 L))^2), biases 0, LayerNorms 1 and 0 (drawn with
``torch.manual_seed``, so not the same numbers; ``--same-init`` copies megatron_like's initial weights instead,
to compare the two trainings step by step). Same recipe as ``pretrain_gpt.py``: AdamW with weight decay on
every matrix (embeddings included) and none on vectors, gradient clipping, Megatron's lr schedule (linear
warmup, then cosine or linear decay to ``--min-lr``; iteration k uses the lr of step k - 1).

The samples are the ones ``pretrain_gpt.py`` reads: the batches come from megatron_like's GPT dataset
(``--data-path``, ``--split``, ``--seed``), so only the model, its initialization and the update differ.
It evaluates at ``--eval-interval`` on the next ``--eval-iters`` global batches of the validation split,
as ``pretrain_gpt.py`` does::

    .venv/bin/python benchmarks/plain_gpt.py --data-path runs/demo/data/docs_text_document \\
        --vocab-file runs/demo/tokenizer/vocab.json --merge-file runs/demo/tokenizer/merges.txt

``benchmarks/learning_quality.py gpt`` runs it next to ``pretrain_gpt.py``.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """x + dropout(attn(ln1(x))), then x + dropout(mlp(ln2(x))) on ``[b, s, h]``.

    Dropout where ours has it: on the attention probabilities and on each branch before the residual add
    (0 by default: the demo pretrains without it; the fine-tune of ``plain_gpt_classification.py`` uses it).
    """

    def __init__(self, hidden: int, heads: int, hidden_dropout: float = 0.0, attention_dropout: float = 0.0) -> None:
        super().__init__()
        self.heads, self.attention_dropout = heads, attention_dropout
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)
        self.dropout = nn.Dropout(hidden_dropout)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)  # (b, nh, s, hd)
        p = self.attention_dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attention(self.ln1(x)))
        return x + self.dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh")))


class PlainGPT(nn.Module):
    """token ids ``[b, s]`` -> logits ``[b, s, vocab]``."""

    def __init__(self, vocab: int, positions: int, num_layers: int, hidden: int, heads: int,
                 std: float = 0.02, hidden_dropout: float = 0.0, attention_dropout: float = 0.0) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, hidden), nn.Embedding(positions, hidden)
        self.dropout = nn.Dropout(hidden_dropout)  # on the embeddings, as ours
        self.blocks = nn.ModuleList(Block(hidden, heads, hidden_dropout, attention_dropout)
                                    for _ in range(num_layers))
        self.norm = nn.LayerNorm(hidden)
        for name, param in self.named_parameters():
            if name.endswith(("proj.weight", "fc2.weight")):
                nn.init.normal_(param, 0.0, std / math.sqrt(2.0 * num_layers))
            elif param.ndim == 2:
                nn.init.normal_(param, 0.0, std)
            elif "ln" not in name and "norm" not in name:
                nn.init.zeros_(param)

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """token ids ``[b, s]`` -> final hidden states ``[b, s, h]`` (after the final LayerNorm)."""
        x = self.dropout(self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device)))
        for block in self.blocks:
            x = block(x)
        return self.norm(x)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.linear(self.hidden(ids), self.tokens.weight)  # tied output layer


@torch.no_grad()
def copy_weights(model: PlainGPT, ours: nn.Module) -> None:
    """Give ``model`` the weights of megatron_like's single-process ``GPTModel`` ``ours`` (same numbers)."""
    h, heads = model.norm.normalized_shape[0], model.blocks[0].heads
    model.tokens.weight.copy_(ours.embedding.word_embeddings.weight)
    model.positions.weight.copy_(ours.embedding.position_embeddings.weight)
    for block, layer in zip(model.blocks, ours.layers, strict=True):
        # Ours lays the fused QKV out head by head ([heads, 3, head_dim]); this model as [3, heads, head_dim].
        qkv = layer.attention.qkv
        block.qkv.weight.copy_(qkv.weight.view(heads, 3, h // heads, h).transpose(0, 1).reshape(3 * h, h))
        block.qkv.bias.copy_(qkv.bias.view(heads, 3, h // heads).transpose(0, 1).reshape(3 * h))
        for mine, theirs in ((block.proj, layer.attention.proj), (block.fc1, layer.mlp.fc1),
                             (block.fc2, layer.mlp.fc2), (block.ln1, layer.ln1), (block.ln2, layer.ln2)):
            mine.load_state_dict(theirs.state_dict())
    model.norm.load_state_dict(ours.final_layernorm.state_dict())


def copy_initial_weights_of_ours(model: PlainGPT, args: argparse.Namespace, vocab: int) -> None:
    """``--same-init``: start from the weights megatron_like's GPTModel draws for ``--seed`` (the same numbers,
    not just the same distribution), so the two trainings can be compared step by step."""
    from megatron_like.config import ModelConfig
    from megatron_like.model import GPTModel
    from megatron_like.parallel_state import ParallelState

    config = ModelConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                         num_attention_heads=args.num_attention_heads, seq_length=args.seq_length)
    copy_weights(model, GPTModel(config, ParallelState.single_process(), vocab_size=vocab, seed=args.seed))


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Megatron's schedule at ``step`` optimizer steps done."""
    if args.lr_warmup_iters and step <= args.lr_warmup_iters:
        return args.lr * step / args.lr_warmup_iters
    progress = (step - args.lr_warmup_iters) / max(1, args.train_iters - args.lr_warmup_iters)
    coefficient = 0.5 * (math.cos(math.pi * progress) + 1.0) if args.lr_decay_style == "cosine" else 1 - progress
    return args.min_lr + coefficient * (args.lr - args.min_lr)


def batch_loss(model: nn.Module, dataset, first: int, size: int) -> torch.Tensor:
    """Mean next-token loss of samples ``[first, first + size)`` of ``dataset`` (``text [s + 1]`` each)."""
    text = torch.stack([torch.from_numpy(dataset[i]["text"]) for i in range(first, first + size)])
    logits = model(text[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), text[:, 1:].flatten())


def train(args: argparse.Namespace) -> dict[str, list]:
    """Train; return {'train': [(iteration, mean loss)], 'valid': [(iteration, validation loss)]}."""
    from megatron_like.data.dataset_builder import build_train_valid_test_datasets
    from megatron_like.data.tokenizer import build_tokenizer

    vocab = build_tokenizer("GPT2BPETokenizer", args.vocab_file, args.merge_file, None, None).vocab_size
    padded_vocab = math.ceil(vocab / args.make_vocab_size_divisible_by) * args.make_vocab_size_divisible_by
    gbs, eval_runs = args.global_batch_size, args.train_iters // args.eval_interval + 1
    num_samples = (args.train_iters * gbs, eval_runs * args.eval_iters * gbs, args.eval_iters * gbs)
    train_ds, valid_ds, _ = build_train_valid_test_datasets([args.data_path], args.split, args.seq_length, args.seed,
                                                            num_samples, None, True, lambda: None)
    torch.manual_seed(args.seed)
    model = PlainGPT(padded_vocab, args.seq_length, args.num_layers, args.hidden_size, args.num_attention_heads)
    if args.same_init:
        copy_initial_weights_of_ours(model, args, padded_vocab)
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim == 1]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=0.0)
    history: dict[str, list] = {"train": [], "valid": []}
    valid_next = 0
    for iteration in range(1, args.train_iters + 1):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(iteration - 1, args)
        optimizer.zero_grad(set_to_none=True)
        # Micro batches accumulate into one global batch, as in pretrain_gpt.py (same sums, same order).
        steps = gbs // args.micro_batch_size
        loss_sum = 0.0
        for micro in range(steps):
            loss = batch_loss(model, train_ds, (iteration - 1) * gbs + micro * args.micro_batch_size,
                              args.micro_batch_size)
            (loss / steps).backward()
            loss_sum += loss.item() / steps
        nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
        optimizer.step()
        if iteration % args.log_interval == 0:  # this iteration's loss, as pretrain_gpt.py logs it
            history["train"].append((iteration, loss_sum))
            print(f" iteration {iteration:4d} | lm loss: {loss_sum:.6E}", flush=True)
        if iteration % args.eval_interval == 0 and args.eval_iters > 0:
            with torch.no_grad():
                model.eval()
                losses = [batch_loss(model, valid_ds, valid_next + i * args.micro_batch_size,
                                     args.micro_batch_size).item()
                          for i in range(args.eval_iters * gbs // args.micro_batch_size)]
                model.train()
            valid_next += args.eval_iters * gbs
            history["valid"].append((iteration, sum(losses) / len(losses)))
            print(f" validation loss at iteration {iteration} | lm loss value: {history['valid'][-1][1]:.6E} |",
                  flush=True)
    if args.save:
        torch.save(model.state_dict(), args.save)
    return history


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The demo's flags (scripts/demo.sh), with its values as defaults."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-path", required=True)
    parser.add_argument("--vocab-file", required=True)
    parser.add_argument("--merge-file", required=True)
    parser.add_argument("--split", default="98,2,0")
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--train-iters", type=int, default=300)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--min-lr", type=float, default=2e-4)
    parser.add_argument("--lr-decay-style", choices=("cosine", "linear"), default="cosine")
    parser.add_argument("--lr-warmup-iters", type=int, default=20)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--clip-grad", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--log-interval", type=int, default=20)
    parser.add_argument("--eval-interval", type=int, default=100)
    parser.add_argument("--eval-iters", type=int, default=5)
    parser.add_argument("--save", help="write the trained model's state_dict to this file")
    parser.add_argument("--same-init", action="store_true",
                        help="start from megatron_like's initial weights for --seed instead of this file's own draw")
    return parser.parse_args(argv)


if __name__ == "__main__":
    train(parse_args())
