"""A freshly initialized ViT sees where its patches are.

Every patch of a flat image region (a blank background, an upscaled pixel) projects to the same vector, so
the only thing telling two such tokens apart is their position embedding. With the position table drawn at
``--init-method-std`` (0.02) the first LayerNorm of those tokens was ~0.98 cosine-similar everywhere: the
model started as a bag of patches, and on scikit-learn's digits (8x8 pixels upscaled to 32x32, patch 4) it
sat at a loss near ln 10 for 100-200 of its 300 iterations (22% top-1 where a plain PyTorch ViT got 63%).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_like.config import ModelConfig
from megatron_like.model.vit import VisionConfig, ViTModel
from megatron_like.parallel_state import ParallelState


def test_position_embeddings_survive_the_first_layernorm_of_flat_patches():
    config = ModelConfig(num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=65)
    model = ViTModel(config, VisionConfig(image_size=32, patch_size=4, num_classes=10),
                     ParallelState.single_process(), seed=1234)
    for value in (1.0, -1.0):  # white and black: the largest patch content the [-1, 1] inputs give
        images = torch.full((1, 3, 32, 32), value)
        tokens = model.embedding.eval()(images)[1:, 0]  # (64 patches, h): identical pixels, different places
        normed = F.layer_norm(tokens, tokens.shape[-1:])
        cosine = normed @ normed.T / normed.shape[-1]  # LayerNorm output has norm sqrt(h)
        off_diagonal = cosine[~torch.eye(len(cosine), dtype=torch.bool)]
        assert off_diagonal.mean() < 0.8, f"flat patches at different places look alike: {off_diagonal.mean():.3f}"
