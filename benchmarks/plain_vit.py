"""A plain single-file PyTorch ViT and its training loop: the reference our ViT's learning is checked against.

Nothing of megatron_like is used: ``nn.TransformerEncoder`` (pre-LN, GELU, dropout 0.1), a linear patch
projection, a learned class token and position embeddings, a final LayerNorm and a linear head on the class
token, PyTorch's default initialization, AdamW (weight decay on matrices only), linear warmup then linear decay,
gradient clipping at 1.0. The images are read from an image folder ``ROOT/{train,val}/<class>/*.png`` with
Pillow and scaled to [-1, 1] (what ``pretrain_vit.py`` does). It prints the training loss every
``--log-interval`` iterations and ends with the top-1 accuracy over the whole validation folder::

    .venv/bin/python benchmarks/plain_vit.py --data-path data/digits --train-iters 300

``benchmarks/learning_quality.py vit`` runs it next to ``pretrain_vit.py`` on the same folder.
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


def read_image_folder(root: str, image_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All images of ``root/<class>/`` as float32 ``[n, 3, image_size, image_size]`` in [-1, 1], labels ``[n]``."""
    from PIL import Image

    images, labels = [], []
    for label, name in enumerate(sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))):
        for file in sorted(os.listdir(os.path.join(root, name))):
            with Image.open(os.path.join(root, name, file)) as image:
                image = image.convert("RGB").resize((image_size, image_size), Image.BILINEAR)
                images.append(np.asarray(image, dtype=np.float32) / 127.5 - 1.0)
            labels.append(label)
    return torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).contiguous(), torch.tensor(labels)


class PlainViT(nn.Module):
    """images ``[b, c, H, W]`` -> logits ``[b, num_classes]``."""

    def __init__(self, image_size: int, patch_size: int, num_classes: int, num_layers: int, hidden_size: int,
                 num_heads: int, dropout: float, num_channels: int = 3) -> None:
        super().__init__()
        self.patch_size = patch_size
        num_patches = (image_size // patch_size) ** 2
        self.patch = nn.Linear(num_channels * patch_size**2, hidden_size)
        self.class_token = nn.Parameter(torch.zeros(1, 1, hidden_size))
        self.position = nn.Parameter(torch.randn(1, num_patches + 1, hidden_size) * 0.02)
        self.dropout = nn.Dropout(dropout)
        layer = nn.TransformerEncoderLayer(hidden_size, num_heads, 4 * hidden_size, dropout, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(hidden_size)
        self.head = nn.Linear(hidden_size, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        b, c, height, width = images.shape
        p = self.patch_size
        patches = images.reshape(b, c, height // p, p, width // p, p).permute(0, 2, 4, 1, 3, 5)
        x = self.patch(patches.reshape(b, -1, c * p * p))  # (b, n, h)
        x = torch.cat([self.class_token.expand(b, -1, -1), x], dim=1) + self.position  # (b, n + 1, h)
        x = self.encoder(self.dropout(x))
        return self.head(self.norm(x[:, 0]))


def lr_at(step: int, lr: float, warmup: int, total: int) -> float:
    """Linear warmup over ``warmup`` steps, then linear decay to 0 at ``total`` (``step`` updates done;
    iteration k uses step k - 1, as Megatron)."""
    if warmup and step <= warmup:
        return lr * step / warmup
    return lr * max(0.0, 1.0 - (step - warmup) / max(1, total - warmup))


@torch.no_grad()
def accuracy(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, batch: int = 256) -> float:
    model.eval()
    correct = sum(int((model(images[i:i + batch]).argmax(-1) == labels[i:i + batch]).sum())
                  for i in range(0, len(labels), batch))
    model.train()
    return correct / len(labels)


def train(args: argparse.Namespace) -> float:
    """Train on ``args.data_path``/train; print the loss as it goes; return the top-1 accuracy on /val."""
    torch.manual_seed(args.seed)
    train_x, train_y = read_image_folder(os.path.join(args.data_path, "train"), args.image_size)
    val_x, val_y = read_image_folder(os.path.join(args.data_path, "val"), args.image_size)
    model = PlainViT(args.image_size, args.patch_size, int(train_y.max()) + 1, args.num_layers, args.hidden_size,
                     args.num_attention_heads, args.dropout)
    decay = [p for p in model.parameters() if p.ndim > 1 and p is not model.class_token and p is not model.position]
    no_decay = [p for p in model.parameters() if all(p is not q for q in decay)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.lr)
    generator = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(len(train_y), generator=generator)
    position = 0
    for step in range(1, args.train_iters + 1):
        if position + args.batch_size > len(order):  # a new epoch, reshuffled
            order, position = torch.randperm(len(train_y), generator=generator), 0
        index = order[position:position + args.batch_size]
        position += args.batch_size
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step - 1, args.lr, args.warmup_iters, args.train_iters)
        loss = F.cross_entropy(model(train_x[index]), train_y[index])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
        optimizer.step()
        if step % args.log_interval == 0:  # this iteration's loss, as pretrain_vit.py logs it
            print(f" iteration {step:4d} | loss: {loss.item():.4f}", flush=True)
    top1 = accuracy(model, val_x, val_y)
    print(f" validation set: {len(val_y)} images | top-1 accuracy: {100 * top1:.2f}", flush=True)
    return top1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-path", required=True, help="image folder root holding train/ and val/")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--patch-size", type=int, default=4)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--train-iters", type=int, default=300)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup-iters", type=int, default=20)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--clip-grad", type=float, default=1.0)
    parser.add_argument("--log-interval", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1234)
    return parser.parse_args(argv)


if __name__ == "__main__":
    train(parse_args())
