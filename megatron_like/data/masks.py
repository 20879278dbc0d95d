"""Attention mask, loss mask and position ids of a GPT batch (``--eod-mask-loss``,
``--reset-position-ids``, ``--reset-attention-mask``), as Megatron's ``get_ltor_masks_and_position_ids``."""

from __future__ import annotations

import torch


def get_ltor_masks_and_position_ids(
    tokens: torch.Tensor,
    eod_token: int,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
    eod_mask_loss: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (attention_mask, loss_mask, position_ids) of a batch of token ids.

    Shapes: attention_mask bool [b or 1, 1, s, s] (True = masked out), loss_mask float [b, s],
    position_ids long [b, s].
    ``tokens`` is long [b, s]. ``reset_attention_mask`` stops attention across end-of-document tokens
    (one mask per sample); ``reset_position_ids`` restarts positions after each one; ``eod_mask_loss``
    zeroes the loss where the input token is the end-of-document token.
    """
    batch, seq = tokens.shape
    mask_batch = batch if reset_attention_mask else 1
    keep = torch.tril(torch.ones((mask_batch, seq, seq), device=tokens.device)).view(mask_batch, 1, seq, seq)
    loss_mask = torch.ones(tokens.shape, dtype=torch.float, device=tokens.device)
    if eod_mask_loss:
        loss_mask[tokens == eod_token] = 0.0
    position_ids = torch.arange(seq, dtype=torch.long, device=tokens.device).unsqueeze(0).expand_as(tokens)
    if reset_position_ids:
        position_ids = position_ids.clone()
    if reset_position_ids or reset_attention_mask:
        for b in range(batch):
            eod_positions = torch.nonzero(tokens[b] == eod_token, as_tuple=False).flatten().tolist()
            previous = 0
            for i in eod_positions:
                if reset_attention_mask:
                    keep[b, 0, i + 1 :, : i + 1] = 0
                if reset_position_ids:
                    position_ids[b, i + 1 :] -= i + 1 - previous
                    previous = i + 1
    return keep < 0.5, loss_mask, position_ids
