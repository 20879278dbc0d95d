"""Train a Vision Transformer image classifier with tensor, pipeline and data parallelism (and ZeRO).

    torchrun --nproc_per_node=4 pretrain_vit.py --pipeline-model-parallel-size 2 --tensor-model-parallel-size 2 \
        --data-path data/images --image-size 32 --patch-size 4 --num-layers 4 --hidden-size 128 \
        --num-attention-heads 4 --micro-batch-size 8 --global-batch-size 32 --train-iters 200 --lr 1e-3

``--data-path ROOT`` reads ``ROOT/train/<class>/*.png`` and ``ROOT/val/<class>/*.png`` (see
``megatron_like/data/image_folder.py``; ``data_tools/make_image_dataset.py`` writes a generated set);
``--mock-data`` generates the same kind of images in memory. The sequence length is derived:
``(image size / patch size)^2 + 1`` (the class token). Training runs through ``megatron_like.training.pretrain``
(logs 'loss' and 'accuracy', validates at --eval-interval, saves and resumes checkpoints); at the end the whole
validation set is evaluated: top-1 accuracy.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from megatron_like import collectives as comm
from megatron_like.config import Config, ConfigError
from megatron_like.data.classification_dataset import EpochDataset
from megatron_like.data.image_folder import (
    SYNTHETIC_CLASSES,
    ImageFolderDataset,
    SyntheticImageDataset,
    class_folders,
)
from megatron_like.model.vit import VisionConfig, ViTModel
from megatron_like.parallel_state import ParallelState
from megatron_like.training import pretrain
from megatron_like.training.checkpoint_validation import exit_on_checkpoint_error
from megatron_like.training.loop import TrainingResult, check_supported
from tasks.common import parse_task_args, print_last_rank, run_or_exit
from tasks.evaluation import classification_counts, evaluate_dataset

MOCK_VALID_IMAGES = 256
"""Size of the generated validation set evaluated in full at the end of a --mock-data run."""


def build_config(argv: list[str] | None = None) -> tuple[Config, VisionConfig]:
    """Parse and validate the flags; the sequence length follows from the image and patch sizes."""
    # ViT has no vocabulary; the value only satisfies the --mock-data rule of the GPT flags.
    # Dropout masks that do not depend on the layout: a tp x pp run is the one-process run (model/dropout.py).
    config, vision = parse_task_args(argv, VisionConfig, "Train a ViT image classifier",
                                     defaults={"model.vocab_size": 1, "model.dropout_rng": "layout-independent"})
    vision.validate()
    if vision.num_classes is None:
        if config.data.mock_data:
            vision.num_classes = len(SYNTHETIC_CLASSES)
        elif config.data.data_path:
            vision.num_classes = len(class_folders(os.path.join(config.data.data_path[0], "train")))
    if not config.data.mock_data and len(config.data.data_path) != 1:
        raise ConfigError(f"--data-path takes one image-folder root (ROOT/train, ROOT/val), got "
                          f"{len(config.data.data_path)} values")
    if config.parallel.context_parallel_size > 1:
        raise ConfigError(f"--context-parallel-size {config.parallel.context_parallel_size}: context parallelism "
                          "splits long text sequences; pretrain_vit.py runs without it")
    if config.model.attention_window is not None:
        raise ConfigError(f"--window-size {config.model.window_size}: ViT attention is bidirectional; sliding windows "
                          "are for causal (GPT) models")
    config.model.seq_length = vision.seq_length
    config.model.max_position_embeddings = None
    # The original ViT's layer init: at GPT-2's N(0, 0.02^2) (output projections / sqrt(2 L)) the residual
    # branches start ~4x (attention output ~7x) smaller than their input at hidden 128, and the class token
    # learns to read the image only after a plateau whose length depends on the seed (docs/workflows.md).
    if vision.gpt2_layer_init and config.model.init_method_xavier_uniform:
        raise ConfigError("--gpt2-layer-init and --init-method-xavier-uniform contradict each other; pass one")
    config.model.init_method_xavier_uniform = not vision.gpt2_layer_init
    config.validate()
    check_supported(config)
    return config, vision


def model_provider(config: Config, ps: ParallelState, *, layers: range, pre_process: bool, post_process: bool,
                   vision: VisionConfig) -> ViTModel:
    """One ViT chunk holding ``layers`` (global indices) of this pipeline rank."""
    return ViTModel(config.model, vision, ps, seed=config.training.seed, layers=layers, pre_process=pre_process,
                    post_process=post_process, sequence_parallel=config.parallel.sequence_parallel,
                    dtype=getattr(torch, config.params_dtype_name))


def loss_func(labels: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Mean cross-entropy of ``logits [b, classes]`` against ``labels [b]``; logs 'loss' and top-1 'accuracy'."""
    loss = F.cross_entropy(logits.float(), labels)
    return loss, {"loss": loss.detach(), "accuracy": (logits.argmax(-1) == labels).float().mean()}


def forward_step(data_iterator: Iterator, model: ViTModel) -> tuple[torch.Tensor, Callable]:
    """One micro batch ``{"image" [b, c, H, W], "label" [b]}`` -> logits and its loss function."""
    batch = next(data_iterator)
    logits = model(batch["image"].to(model.ps.device))
    return logits, functools.partial(loss_func, batch["label"].to(model.ps.device))


def eval_forward_step(data_iterator: Iterator, model: ViTModel) -> tuple[torch.Tensor, Callable]:
    """Like forward_step; the loss function returns the summed counts of tasks.evaluation."""
    batch = next(data_iterator)
    logits = model(batch["image"].to(model.ps.device))
    labels, valid = batch["label"].to(model.ps.device), batch["valid"].to(model.ps.device)

    def counts(output: torch.Tensor) -> tuple[torch.Tensor, dict]:
        stats = classification_counts(output, labels, valid)
        return stats["loss_sum"] / stats["count"].clamp(min=1), stats

    return logits, counts


def base_datasets(config: Config, vision: VisionConfig) -> tuple[Any, Any]:
    """(train, validation) image datasets before epoch sampling (validation may be None)."""
    seed = config.training.seed
    if config.data.mock_data:
        return None, SyntheticImageDataset(MOCK_VALID_IMAGES, vision.image_size, vision.num_channels, seed + 1)
    root = config.data.data_path[0]
    train = ImageFolderDataset(os.path.join(root, "train"), vision.image_size, vision.num_channels)
    val_root = os.path.join(root, "val")
    valid = (ImageFolderDataset(val_root, vision.image_size, vision.num_channels, classes=train.classes)
             if os.path.isdir(val_root) else None)
    return train, valid


def sample_streams(train: Any, valid: Any, vision: VisionConfig, seed: int,
                   num_samples: tuple[int, int, int]) -> tuple[Any, Any, None]:
    """The (train, validation, test) sample streams ``pretrain()`` reads, of ``num_samples`` each.

    Both folders are drawn in a seeded shuffle, reshuffled every epoch: folder order is class-sorted, so the
    ``--eval-iters`` batches of an in-training validation would otherwise hold one or two classes only.
    """
    if train is None:  # --mock-data: fresh generated images, a separate stream for validation
        train_ds = SyntheticImageDataset(num_samples[0], vision.image_size, vision.num_channels, seed)
    else:
        train_ds = EpochDataset(train, num_samples[0], seed)
    valid_ds = EpochDataset(valid, num_samples[1], seed + 1) if valid and num_samples[1] else None
    return train_ds, valid_ds, None


def train_vit(config: Config, vision: VisionConfig, ps: ParallelState | None = None) -> tuple[TrainingResult,
                                                                                            dict[str, float]]:
    """Train with ``pretrain()``; return its result and the top-1 accuracy over the whole validation set."""
    train, valid = base_datasets(config, vision)

    def datasets_provider(config: Config, ps: ParallelState, num_samples: tuple[int, int, int]) -> tuple[Any, ...]:
        return sample_streams(train, valid, vision, config.training.seed, num_samples)

    provider = functools.partial(model_provider, vision=vision)
    result = pretrain(config, provider, forward_step, datasets_provider, ps=ps)
    metrics: dict[str, float] = {}
    if valid is not None:
        metrics = evaluate_dataset(config, result.model[0].ps, result.model, eval_forward_step, valid, binary=False)
        if metrics:
            print_last_rank(f" validation set: {int(metrics['samples'])} images | top-1 accuracy: "
                            f"{100 * metrics['accuracy']:.2f} | loss: {metrics['loss']:.6E} |")
    return result, metrics


def main(argv: list[str] | None = None) -> None:
    config, vision = run_or_exit(lambda: build_config(argv))
    with exit_on_checkpoint_error():
        train_vit(config, vision)
    comm.shutdown()


if __name__ == "__main__":
    main()
