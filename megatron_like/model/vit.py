"""Vision Transformer (ViT) for image classification, built from the same tensor-parallel blocks as GPT.

An image ``[b, c, H, W]`` is cut into ``n = (H / p) * (W / p)`` patches of ``p x p`` pixels, each patch
is projected to the hidden size, a learned class token is put in front and learned position embeddings
are added: the sequence is ``s = n + 1`` tokens ``[s, b, h]``. The transformer layers are GPT's with
bidirectional attention (``causal=False``). The last chunk normalizes the class token's final state and
maps it to ``num_classes`` logits.

One ``ViTModel`` is one pipeline chunk, like ``GPTModel``: the first chunk owns the patch embedding,
the last owns the head. Every weight is drawn from its own named generator, so any tp/pp layout holds
exact slices of the single-process model built with the same seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megatron_like.config import ConfigError, ModelConfig
from megatron_like.model.dropout import ActivationDropout
from megatron_like.model.norms import build_norm
from megatron_like.model.transformer import TransformerLayer, embeddings_to_layers, forward_layers
from megatron_like.parallel_state import ParallelState
from megatron_like.tensor_parallel import (
    gather_from_sequence_parallel_region,
    init_generator,
    mark_replicated,
    new_parameter,
    normal_init,
)
from megatron_like.tensor_parallel.initialization import draw_slice


@dataclass
class VisionConfig:
    """Images and classes of a ViT run (flags of pretrain_vit.py)."""

    image_size: int = 32
    """Height and width of the (square) input images in pixels; folder images are resized to it."""
    patch_size: int = 4
    """Side of the square patches; --image-size must be a multiple of it."""
    num_channels: int = 3
    """Channels of the input images (3 = RGB)."""
    num_classes: int | None = None
    """Classes of the head; defaults to the class folders under --data-path (4 with --mock-data)."""
    gpt2_layer_init: bool = False
    """Draw the transformer layers as GPT does, N(0, --init-method-std^2) with the output projections scaled by
    1/sqrt(2 * layers), instead of the ViT's Xavier uniform (--init-method-xavier-uniform, on by default here):
    the init before issue 32, whose start is a long, seed-dependent plateau (docs/workflows.md)."""

    def validate(self) -> None:
        for name in ("image_size", "patch_size", "num_channels"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} {getattr(self, name)} must be positive")
        if self.image_size % self.patch_size:
            raise ConfigError(f"--image-size {self.image_size} is not a multiple of --patch-size {self.patch_size}")
        if self.num_classes is not None and self.num_classes < 2:
            raise ConfigError(f"--num-classes {self.num_classes} must be at least 2")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def seq_length(self) -> int:
        """Tokens per image: one per patch plus the class token."""
        return self.num_patches + 1


def replicated_parameter(shape: tuple[int, ...], std: float, seed: int, name: str, dtype: torch.dtype,
                         device: torch.device) -> nn.Parameter:
    """A parameter every tp rank holds whole, ~N(0, std^2) from its own named generator (0 when std is 0)."""

    def fill(out: torch.Tensor) -> None:
        if std > 0:
            draw_slice(out, normal_init(std), init_generator(seed, name), shape)
        else:
            out.zero_()

    return mark_replicated(new_parameter(shape, dtype, device, fill), sequence_parallel=False)


def patchify(images: torch.Tensor, patch_size: int) -> torch.Tensor:
    """``[b, c, H, W]`` -> ``[b, n, c * p * p]``: patches in row-major order, each flattened channel-first."""
    b, c, height, width = images.shape
    p = patch_size
    patches = images.reshape(b, c, height // p, p, width // p, p).permute(0, 2, 4, 1, 3, 5)  # (b, H/p, W/p, c, p, p)
    return patches.reshape(b, (height // p) * (width // p), c * p * p)


class ViTEmbedding(nn.Module):
    """Patch projection, class token, position embeddings, dropout: images ``[b, c, H, W]`` -> ``[s, b, h]``."""

    def __init__(self, config: ModelConfig, vision: VisionConfig, ps: ParallelState, seed: int,
                 sequence_parallel: bool, dtype: torch.dtype) -> None:
        super().__init__()
        h, std, device = config.hidden_size, config.init_method_std, ps.device
        self.patch_size, self.dtype = vision.patch_size, dtype
        self.tp_group, self.sequence_parallel = ps.tp_group, sequence_parallel
        self.dropout = ActivationDropout(config, ps, sequence_parallel, "embedding")
        patch_dim = vision.num_channels * vision.patch_size**2
        self.patch_weight = replicated_parameter((h, patch_dim), std, seed, "embedding.patch_weight", dtype, device)
        self.patch_bias = replicated_parameter((h,), 0.0, seed, "embedding.patch_bias", dtype, device)
        # 1-D like the LayerNorms, so the optimizer leaves it undecayed (as ViT implementations do).
        self.class_token = replicated_parameter((h,), std, seed, "embedding.class_token", dtype, device)
        # std 1/sqrt(h), as the original ViT, not --init-method-std: every patch of a flat image region projects
        # to the same vector, so at 0.02 the LayerNorm of a token is nearly its patch content alone and the
        # model starts position-blind (a bag of patches); Adam then spends 100+ steps growing this table first.
        self.position_embeddings = replicated_parameter(
            (vision.seq_length, h), h**-0.5, seed, "embedding.position_embeddings", dtype, device
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        patches = patchify(images.to(self.dtype), self.patch_size)  # (b, n, c p p)
        x = F.linear(patches, self.patch_weight, self.patch_bias)  # (b, n, h)
        cls = self.class_token.expand(x.shape[0], 1, -1)  # (b, 1, h)
        x = torch.cat([cls, x], dim=1) + self.position_embeddings  # (b, s, h)
        return embeddings_to_layers(x, self.tp_group, self.sequence_parallel, self.dropout, self.training)


class ViTModel(nn.Module):
    """A chunk of ViT: [embedding] -> bidirectional layers -> [final LayerNorm -> class-token head].

    Args:
        vision: image and patch sizes and the number of classes (``num_classes`` must be set).
        layers: global indices of the transformer layers this chunk holds.
        pre_process: this chunk takes images (first pipeline stage).
        post_process: this chunk produces the logits (last pipeline stage).
    """

    def __init__(self, config: ModelConfig, vision: VisionConfig, ps: ParallelState, *, seed: int,
                 layers: range | None = None, pre_process: bool = True, post_process: bool = True,
                 sequence_parallel: bool = False, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if vision.num_classes is None:
            raise ValueError("ViTModel needs vision.num_classes")
        layers = range(config.num_layers) if layers is None else layers
        self.config, self.vision, self.ps = config, vision, ps
        self.pre_process, self.post_process = pre_process, post_process
        self.sequence_parallel = sequence_parallel
        self.input_tensor: torch.Tensor | None = None
        if pre_process:
            self.embedding = ViTEmbedding(config, vision, ps, seed, sequence_parallel, dtype)
        self.layers = nn.ModuleList(
            TransformerLayer(config, ps, layer, seed, sequence_parallel, dtype, causal=False) for layer in layers
        )
        if post_process:
            self.final_layernorm = build_norm(config, sequence_parallel, dtype, ps.device)
            h, c = config.hidden_size, vision.num_classes
            self.head_weight = replicated_parameter((c, h), config.init_method_std, seed, "head.weight", dtype,
                                                    ps.device)
            self.head_bias = replicated_parameter((c,), 0.0, seed, "head.bias", dtype, ps.device)

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        """Hidden states ``[s, b, h]`` received from the previous pipeline stage."""
        self.input_tensor = tensor

    def forward(self, images: torch.Tensor | None = None, hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        """Run this chunk.

        Args:
            images: ``[b, c, H, W]`` (first chunk only).
            hidden_states: ``[s, b, h]`` (``[s / tp, b, h]`` with sequence parallelism) from the previous
                stage; defaults to the tensor given to ``set_input_tensor``.
        Returns:
            logits ``[b, num_classes]`` on the last chunk, the hidden states for the next stage elsewhere.
        """
        if self.pre_process:
            hidden_states = self.embedding(images)
        elif hidden_states is None:
            hidden_states = self.input_tensor
        if hidden_states is None:
            raise ValueError("a chunk without the embedding needs hidden_states from the previous stage")
        hidden_states = forward_layers(self.layers, hidden_states, self.config)
        if not self.post_process:
            return hidden_states
        hidden_states = self.final_layernorm(hidden_states)
        if self.sequence_parallel:
            # The class token sits in tp rank 0's shard; every rank computes the (replicated) head on it, so
            # the backward keeps each rank's own slice of the full gradient (no reduction).
            hidden_states = gather_from_sequence_parallel_region(hidden_states, self.ps.tp_group,
                                                                 grad_is_partial=False)  # (s, b, h)
        return F.linear(hidden_states[0], self.head_weight, self.head_bias)  # (b, num_classes)
