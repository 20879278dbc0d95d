"""A plain single-file PyTorch ViT built from PyTorch's defaults: the reference our ViT's learning is checked against.

Nothing of megatron_like is used, and nothing is tuned: every choice below is PyTorch's default or the common
ViT recipe.

- Model: a ``nn.Linear`` patch projection (PyTorch's default initialization), a zero-initialized class token,
  position embeddings drawn at std 0.02, dropout 0.1 on the embeddings, ``nn.TransformerEncoder`` of
  ``nn.TransformerEncoderLayer(norm_first=True, activation="gelu", dropout=0.1)`` (PyTorch's own initialization
  of attention and MLP), a final ``nn.LayerNorm`` and a ``nn.Linear`` head (default initialization) on the class
  token.
- Update: ``torch.optim.AdamW`` with its defaults (betas 0.9 / 0.999, eps 1e-8, weight decay 0.01 on every
  parameter), no gradient clipping; ``LambdaLR``: linear warmup then linear decay to 0.
- Data: pixels in [0, 1] (``ToTensor``'s range), read with Pillow from ``ROOT/{train,val}/<class>/*.png``; a
  ``DataLoader`` reshuffling the training set every epoch (``torch.manual_seed(--seed)`` fixes the initial
  weights, the order and the dropout masks).

What it shares with ``pretrain_vit.py``'s recipe (the README's): the sizes (4 layers, hidden 128, 4 heads, MLP
4 x hidden, patch 4 on 32x32 RGB), 32 images per iteration, lr 1e-3 with 20 warmup iterations then linear decay,
300 iterations, dropout 0.1, the image folder, and top-1 over the whole validation folder at the end. It prints
the training loss every ``--log-interval`` iterations and ends with that accuracy::

    .venv/bin/python benchmarks/plain_vit.py --data-path data/digits --seed 1

``benchmarks/learning_quality.py vit`` runs it next to ``pretrain_vit.py`` on the same folder.
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def read_image_folder(root: str) -> tuple[torch.Tensor, torch.Tensor]:
    """All images of ``root/<class>/`` as float32 ``[n, 3, H, W]`` in [0, 1], and their labels ``[n]``."""
    from PIL import Image

    images, labels = [], []
    for label, name in enumerate(sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))):
        for file in sorted(os.listdir(os.path.join(root, name))):
            with Image.open(os.path.join(root, name, file)) as image:
                images.append(np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0)
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


def warmup_then_linear_decay(warmup: int, total: int):
    """``LambdaLR`` factor of step ``s`` (0-based): ``(s + 1) / warmup`` up to 1, then linear to 0 at ``total``."""
    return lambda s: min((s + 1) / max(1, warmup), max(0.0, (total - s) / max(1, total - warmup)))


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
    train_x, train_y = read_image_folder(os.path.join(args.data_path, "train"))
    val_x, val_y = read_image_folder(os.path.join(args.data_path, "val"))
    model = PlainViT(train_x.shape[-1], args.patch_size, int(train_y.max()) + 1, args.num_layers, args.hidden_size,
                     args.num_attention_heads, args.dropout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_then_linear_decay(args.warmup_iters, args.train_iters))
    # drop_last: every iteration sees --batch-size images, as ours does.
    loader = DataLoader(TensorDataset(train_x, train_y), batch_size=args.batch_size, shuffle=True, drop_last=True)
    step = 0
    while step < args.train_iters:
        for images, labels in loader:
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            step += 1
            if step % args.log_interval == 0:  # this iteration's loss, as pretrain_vit.py logs it
                print(f" iteration {step:4d} | loss: {loss.item():.4f}", flush=True)
            if step == args.train_iters:
                break
    top1 = accuracy(model, val_x, val_y)
    print(f" validation set: {len(val_y)} images | top-1 accuracy: {100 * top1:.2f}", flush=True)
    return top1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-path", required=True, help="image folder root holding train/ and val/")
    parser.add_argument("--patch-size", type=int, default=4)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--train-iters", type=int, default=300)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup-iters", type=int, default=20)
    parser.add_argument("--weight-decay", type=float, default=0.01, help="AdamW's default, on every parameter")
    parser.add_argument("--log-interval", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1234)
    return parser.parse_args(argv)


if __name__ == "__main__":
    train(parse_args())
