"""``pretrain_vit.py`` with parts of its start swapped for a plain PyTorch ViT's: which part made ours plateau?

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/vit_init_ablation.py --swap layers_pytorch --gpt2-layer-init \\
        <pretrain_vit.py flags: the README recipe, --data-path runs/learning_quality/digits, --seed 1234,
         --exit-interval 150 --eval-interval 50>

Each ``--swap`` replaces one part after our model is built (drawn from a generator of ``--seed``); everything
else is ``pretrain_vit.py`` as it is. Issue 32's candidates and what ``benchmarks/plain_vit.py`` does instead:

- ``pixels01``: pixels in [0, 1] instead of [-1, 1];
- ``patch_pytorch``: the patch projection at ``nn.Linear``'s default, U(+-1/sqrt(fan_in)) weight and bias;
- ``class_token_zero``: the class token at 0;
- ``position_002``: the position table at N(0, 0.02^2) instead of 1/sqrt(h);
- ``head_pytorch``: the head at ``nn.Linear``'s default;
- ``layers_pytorch``: every transformer layer as ``nn.TransformerEncoderLayer`` draws it (Xavier-uniform fused
  QKV, ``nn.Linear`` defaults for the attention output and the MLP, MLP biases included).

Single process only (the swaps draw whole tensors). Results: docs/performance.md, "Learning quality".
"""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pretrain_vit  # noqa: E402
from megatron_like.data import image_folder  # noqa: E402
from megatron_like.tensor_parallel import init_generator  # noqa: E402

SWAPS = ("pixels01", "patch_pytorch", "class_token_zero", "position_002", "head_pytorch", "layers_pytorch")


def linear_default_(weight: torch.Tensor, bias: torch.Tensor | None, generator: torch.Generator) -> None:
    """``nn.Linear``'s default init: weight and bias ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    bound = 1 / math.sqrt(weight.shape[1])
    weight.uniform_(-bound, bound, generator=generator)
    if bias is not None:
        bias.uniform_(-bound, bound, generator=generator)


@torch.no_grad()
def swap_parts(model: torch.nn.Module, swaps: set[str], generator: torch.Generator) -> None:
    """Redraw the ``swaps`` parts of a single-process ``ViTModel`` as a plain PyTorch ViT draws them."""
    embedding = model.embedding
    if "patch_pytorch" in swaps:
        linear_default_(embedding.patch_weight, embedding.patch_bias, generator)
    if "class_token_zero" in swaps:
        embedding.class_token.zero_()
    if "position_002" in swaps:
        embedding.position_embeddings.normal_(0.0, 0.02, generator=generator)
    if "layers_pytorch" in swaps:
        for layer in model.layers:
            torch.nn.init.xavier_uniform_(layer.attention.qkv.weight, generator=generator)
            linear_default_(layer.attention.proj.weight, None, generator)  # its bias stays 0, as MHA's
            linear_default_(layer.mlp.fc1.weight, layer.mlp.fc1.bias, generator)
            linear_default_(layer.mlp.fc2.weight, layer.mlp.fc2.bias, generator)
    if "head_pytorch" in swaps:
        linear_default_(model.head_weight, model.head_bias, generator)


def main(argv: list[str]) -> None:
    swaps = set()
    while "--swap" in argv:
        at = argv.index("--swap")
        swaps.add(argv[at + 1])
        argv = argv[:at] + argv[at + 2:]
    unknown = swaps - set(SWAPS)
    if unknown:
        raise SystemExit(f"error: --swap {', '.join(sorted(unknown))} is not one of {', '.join(SWAPS)}")
    print(f" > swapped for plain PyTorch's: {', '.join(sorted(swaps)) or 'nothing'}", flush=True)
    if "pixels01" in swaps:
        image_folder.to_model_input = lambda pixels: (pixels.astype(np.float32) / 255.0).transpose(2, 0, 1).copy()
    build = pretrain_vit.model_provider

    def provider(config, ps, **kwargs):
        if ps.world_size > 1:
            raise SystemExit("error: vit_init_ablation.py runs in one process")
        model = build(config, ps, **kwargs)
        swap_parts(model, swaps, init_generator(config.training.seed, "vit_init_ablation"))
        return model

    pretrain_vit.model_provider = provider
    pretrain_vit.main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
