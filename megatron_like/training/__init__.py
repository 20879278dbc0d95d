"""The trainer: loop, lr schedule, data loading, metrics, checkpoints."""

from megatron_like.training.loop import TrainingResult, pretrain

__all__ = ["TrainingResult", "pretrain"]
