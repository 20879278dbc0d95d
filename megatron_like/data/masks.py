"""Packed documents in a GPT batch: document ids, loss mask and position ids (``--reset-attention-mask``,
``--eod-mask-loss``, ``--reset-position-ids``), as Megatron's ``get_ltor_masks_and_position_ids`` but without its
``[b, 1, s, s]`` mask: attention learns the document boundaries from ``document_ids [b, s]`` and skips the key blocks
of other documents (``model/blockwise_attention.py``).

A sample of ``s`` tokens may hold several documents, each ending with the end-of-document token (``--append-eod`` at
preprocessing). The end-of-document token belongs to the document it ends; the next token starts a new one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def get_ltor_documents_and_position_ids(
    tokens: torch.Tensor,
    eod_token: int | None,
    *,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
    eod_mask_loss: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Return (document_ids, loss_mask, position_ids) of a batch of token ids ``tokens`` long ``[b, s]``.

    document_ids: long ``[b, s]``, the number of end-of-document tokens before each token (attention stays within
    equal ids), or None without ``reset_attention_mask`` (one sequence per sample). loss_mask: float ``[b, s]``,
    0 where the input token is end-of-document when ``eod_mask_loss`` (its target is the next document's first
    token). position_ids: long ``[b, s]``, restarting at 0 after each end-of-document token when
    ``reset_position_ids``, else ``0 .. s - 1``.
    """
    batch, seq = tokens.shape
    if eod_token is None and (reset_position_ids or reset_attention_mask or eod_mask_loss):
        raise ValueError("packed-document flags need an end-of-document token; this data has none")
    is_eod = tokens == eod_token if eod_token is not None else torch.zeros_like(tokens, dtype=torch.bool)
    index = torch.arange(seq, device=tokens.device).expand(batch, seq)
    loss_mask = torch.ones(tokens.shape, dtype=torch.float, device=tokens.device)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0
    document_ids = None
    if reset_attention_mask:
        document_ids = torch.cumsum(is_eod, dim=1) - is_eod.long()  # eods strictly before each token
    position_ids = index
    if reset_position_ids:
        # Where each token's document starts: one past the last end-of-document token before it (0 if none).
        next_start = torch.where(is_eod, index + 1, torch.zeros_like(index))
        start = torch.cummax(F.pad(next_start[:, :-1], (1, 0)), dim=1).values
        position_ids = index - start
    return document_ids, loss_mask, position_ids.contiguous()

