"""Fine-tune a pretrained GPT for sentence-pair classification (GLUE MRPC style) in any parallel layout.

    torchrun --nproc_per_node=4 finetune_gpt_classification.py \
        --pretrained-checkpoint ckpt/gpt --train-data data/mrpc_like/train.tsv --valid-data data/mrpc_like/dev.tsv \
        --num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 \
        --pipeline-model-parallel-size 2 --use-distributed-optimizer --fp16 \
        --epochs 3 --micro-batch-size 8 --global-batch-size 32 --lr 2.4e-5 --scale-lr-by-world-size

The recipe of the seed tutorial is the default: linear warmup over the first 10% of the iterations then
linear decay, weight decay 0.01 except biases and LayerNorms (the optimizer's rule for 1-D parameters),
cross-entropy on the last real token's logits. The model flags must match the pretrained checkpoint
(``pretrain_gpt.py --save``, any tp/pp layout; a Hugging Face GPT-2 converted with ``tools/convert_hf.py
from-hf`` works the same way). Training runs through ``megatron_like.training.pretrain`` (tp, pp, dp,
ZeRO, fp16/bf16, checkpoints, ``--load`` resumes); the dev set is evaluated in full at the end: accuracy
and F1 of class 1.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from megatron_like import collectives as comm
from megatron_like.config import Config, ConfigError
from megatron_like.data.classification_dataset import EpochDataset, SentencePairDataset, read_sentence_pairs
from megatron_like.model.classification import GPTClassificationModel, load_pretrained_gpt, pretrained_shape_mismatch
from megatron_like.model.state import TRACKER_FILE, CheckpointLoadError, read_saved_config
from megatron_like.parallel_state import ParallelState
from megatron_like.training import pretrain
from megatron_like.training.checkpoint_validation import exit_on_checkpoint_error
from megatron_like.training.checkpointing import CheckpointError
from megatron_like.training.loop import TrainingResult, check_supported
from tasks.common import parse_task_args, print_last_rank, run_or_exit
from tasks.evaluation import classification_counts, evaluate_dataset


@dataclass
class ClassificationConfig:
    """Sentence-pair classification task."""

    train_data: str | None = None
    """Training examples: TSV or JSONL with sentence1, sentence2, label (see classification_dataset.py)."""
    valid_data: str | None = None
    """Dev examples in the same format: evaluated in full at the end (accuracy, F1), sampled at --eval-interval."""
    pretrained_checkpoint: str | None = None
    """GPT checkpoint to start from (pretrain_gpt.py --save, any tp/pp layout); without it the body is random."""
    num_classes: int = 2
    """Classes of the head (labels are 0 .. num_classes - 1)."""
    epochs: float | None = None
    """Passes over the training set; sets --train-iters to ceil(epochs * examples / global batch size)."""
    scale_lr_by_world_size: bool = False
    """Multiply --lr and --min-lr by the number of processes (the seed tutorial's rule)."""


def build_config(argv: list[str] | None = None) -> tuple[Config, ClassificationConfig]:
    """Parse and validate the flags; derive the iterations from --epochs and scale the learning rate."""
    config, task = parse_task_args(argv, ClassificationConfig, "Fine-tune GPT for sequence classification",
                                   defaults={"optimizer.lr_warmup_fraction": 0.1, "optimizer.weight_decay": 0.01,
                                             "model.dropout_rng": "layout-independent"})
    if task.train_data is None:
        raise ConfigError("--train-data is required (TSV or JSONL with sentence1, sentence2, label)")
    if task.num_classes < 2:
        raise ConfigError(f"--num-classes {task.num_classes} must be at least 2")
    if config.parallel.context_parallel_size > 1:
        raise ConfigError(f"--context-parallel-size {config.parallel.context_parallel_size}: the classifier reads the "
                          "last token of whole sequences; fine-tune without context parallelism")
    if task.pretrained_checkpoint:
        check_pretrained_checkpoint(task.pretrained_checkpoint, config)
    config.data.data_path = [task.train_data]
    if task.epochs is not None:
        if task.epochs <= 0:
            raise ConfigError(f"--epochs {task.epochs} must be positive")
        examples = len(read_sentence_pairs(task.train_data))
        config.training.train_iters = max(1, math.ceil(task.epochs * examples / config.global_batch_size))
    if task.scale_lr_by_world_size:
        config.optimizer.lr *= config.world_size
        config.optimizer.min_lr *= config.world_size
    config.validate()
    check_supported(config)
    return config, task


def check_pretrained_checkpoint(root: str, config: Config) -> None:
    """Raise a one-line ConfigError, before any work, unless ``root`` is a GPT checkpoint whose saved model shape
    is ``config.model``'s (its weights are read later, by every pipeline stage when it builds its chunk)."""
    fix = "pass the directory pretrain_gpt.py --save wrote"
    if not os.path.isfile(os.path.join(root, TRACKER_FILE)):
        what = "is missing" if not os.path.exists(root) else f"holds no {TRACKER_FILE}"
        raise ConfigError(f"--pretrained-checkpoint {root} {what}; {fix}")
    try:
        saved = read_saved_config(root)
    except (CheckpointLoadError, CheckpointError) as error:
        raise ConfigError(f"--pretrained-checkpoint {root} cannot be read: {error}; {fix}") from None
    problem = pretrained_shape_mismatch(saved.model, config.model, root)
    if problem:
        raise ConfigError(problem)


def model_provider(config: Config, ps: ParallelState, *, layers: range, pre_process: bool, post_process: bool,
                   task: ClassificationConfig, padded_vocab_size: int) -> GPTClassificationModel:
    """One classification chunk holding ``layers``, its GPT body loaded from --pretrained-checkpoint."""
    chunk = GPTClassificationModel(
        config.model, ps, vocab_size=padded_vocab_size, num_classes=task.num_classes, seed=config.training.seed,
        layers=layers, pre_process=pre_process, post_process=post_process,
        sequence_parallel=config.parallel.sequence_parallel, dtype=getattr(torch, config.params_dtype_name),
    )
    if task.pretrained_checkpoint:
        fresh = load_pretrained_gpt(chunk, task.pretrained_checkpoint)
        if ps.dp_rank == 0 and ps.tp_rank == 0:
            print(f" > loaded GPT body of pipeline rank {ps.pp_rank} from {task.pretrained_checkpoint}; "
                  f"initialized: {fresh or 'nothing'}", flush=True)
    return chunk


def _forward(data_iterator: Iterator, model: GPTClassificationModel) -> tuple[torch.Tensor, dict]:
    batch = next(data_iterator)
    device = model.ps.device
    tokens = batch["tokens"].to(device)
    positions = torch.arange(tokens.shape[1], device=device).unsqueeze(0).expand_as(tokens)
    return model(tokens, positions, last_index=batch["last_index"].to(device)), batch


def loss_func(labels: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Mean cross-entropy of ``logits [b, c]`` against ``labels [b]``; logs 'loss' and 'accuracy'."""
    loss = F.cross_entropy(logits.float(), labels)
    accuracy = (logits.argmax(-1) == labels).float().mean()
    return loss, {"loss": loss.detach(), "accuracy": accuracy}


def forward_step(data_iterator: Iterator, model: GPTClassificationModel) -> tuple[torch.Tensor, Callable]:
    """One micro batch ``{"tokens" [b, s], "last_index" [b], "label" [b]}`` -> logits and its loss."""
    logits, batch = _forward(data_iterator, model)
    return logits, functools.partial(loss_func, batch["label"].to(model.ps.device))


def eval_forward_step(data_iterator: Iterator, model: GPTClassificationModel) -> tuple[torch.Tensor, Callable]:
    """Like forward_step, but the loss function returns the summed counts of tasks.evaluation."""
    logits, batch = _forward(data_iterator, model)
    labels, valid = batch["label"].to(model.ps.device), batch["valid"].to(model.ps.device)

    def counts(output: torch.Tensor) -> tuple[torch.Tensor, dict]:
        stats = classification_counts(output, labels, valid)
        return stats["loss_sum"] / stats["count"].clamp(min=1), stats

    return logits, counts


@dataclass
class FinetuneResult:
    training: TrainingResult
    dev_metrics: dict[str, float]
    """accuracy, f1, loss, samples over the whole dev set (last pipeline stage; {} elsewhere)."""


def sample_streams(train: Any, dev: Any, seed: int, num_samples: tuple[int, int, int]) -> tuple[Any, Any, None]:
    """The (train, validation, test) sample streams ``pretrain()`` reads, of ``num_samples`` each.

    Both sets are drawn in a seeded shuffle, reshuffled every epoch: the ``--eval-iters`` batches of an
    in-training validation are then a fair draw even when the dev file is sorted by label.
    """
    valid = EpochDataset(dev, num_samples[1], seed + 1) if dev is not None and num_samples[1] else None
    return EpochDataset(train, num_samples[0], seed), valid, None


def finetune(config: Config, task: ClassificationConfig, ps: ParallelState | None = None) -> FinetuneResult:
    """Fine-tune with ``pretrain()``, then evaluate the whole dev set."""
    from megatron_like.data.tokenizer import build_tokenizer

    d = config.data
    tokenizer = build_tokenizer(d.tokenizer_type, d.vocab_file, d.merge_file, d.tokenizer_model,
                                config.model.vocab_size)
    padded_vocab_size = config.padded_vocab_size(tokenizer.vocab_size)
    make = functools.partial(SentencePairDataset, tokenize=tokenizer.tokenize, seq_length=config.model.seq_length,
                             sep_id=tokenizer.eod, pad_id=tokenizer.eod, num_classes=task.num_classes)
    train = make(task.train_data)
    dev = make(task.valid_data) if task.valid_data else None
    print_last_rank(f" > fine-tuning on {len(train)} examples for {config.training.train_iters} iterations of "
                    f"{config.global_batch_size}; lr {config.optimizer.lr:.3E}")

    def datasets_provider(config: Config, ps: ParallelState, num_samples: tuple[int, int, int]) -> tuple[Any, ...]:
        return sample_streams(train, dev, config.training.seed, num_samples)

    provider = functools.partial(model_provider, task=task, padded_vocab_size=padded_vocab_size)
    result = pretrain(config, provider, forward_step, datasets_provider, ps=ps, padded_vocab_size=padded_vocab_size)
    metrics: dict[str, float] = {}
    if dev is not None:
        ps = result.model[0].ps
        metrics = evaluate_dataset(config, ps, result.model, eval_forward_step, dev, binary=task.num_classes == 2)
        if metrics:
            line = f" dev set: {int(metrics['samples'])} examples | accuracy: {100 * metrics['accuracy']:.2f}"
            if "f1" in metrics:
                line += f" | F1: {100 * metrics['f1']:.2f}"
            print_last_rank(line + f" | loss: {metrics['loss']:.6E} |")
    return FinetuneResult(result, metrics)


def main(argv: list[str] | None = None) -> None:
    config, task = run_or_exit(lambda: build_config(argv))
    with exit_on_checkpoint_error():
        finetune(config, task)
    comm.shutdown()


if __name__ == "__main__":
    main()
