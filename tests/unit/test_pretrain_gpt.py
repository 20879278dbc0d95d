"""The model-specific pieces of pretrain_gpt.py: batch splitting, eod loss masking, masked mean loss."""

from __future__ import annotations

import torch

import pretrain_gpt
from megatron_like.config import DataConfig


def test_get_batch_shifts_labels_and_masks_eod():
    text = torch.tensor([[5, 6, 0, 7, 8], [1, 2, 3, 4, 0]])
    masking = DataConfig(data_path=["corpus"], eod_mask_loss=True)
    batch = pretrain_gpt.get_batch(iter([{"text": text}]), torch.device("cpu"), eod_token=0, data=masking)
    assert batch["tokens"].tolist() == [[5, 6, 0, 7], [1, 2, 3, 4]]
    assert batch["labels"].tolist() == [[6, 0, 7, 8], [2, 3, 4, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3]] * 2
    # The prediction made at the eod input (the next document's first token) is not trained on.
    assert batch["loss_mask"].tolist() == [[1, 1, 0, 1], [1, 1, 1, 1]]
    assert batch["document_ids"] is None  # one sequence per sample without --reset-attention-mask
    unmasked = pretrain_gpt.get_batch(iter([{"text": text}]), torch.device("cpu"), eod_token=0)
    assert unmasked["loss_mask"].sum() == 8


def test_loss_is_the_mean_over_unmasked_tokens():
    per_token = torch.tensor([[1.0, 2.0], [3.0, 10.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, stats = pretrain_gpt.loss_func(mask, per_token)
    assert loss.item() == 2.0 and stats["lm loss"].item() == 2.0
