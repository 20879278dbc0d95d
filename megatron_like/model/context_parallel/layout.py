"""Which tokens a context-parallel rank holds, and the loss over the whole sequence.

The sequence is cut into ``2 cp`` equal chunks; cp rank ``r`` keeps chunks ``r`` and ``2 cp - 1 - r`` (Megatron's
load balancing: under a causal mask the early chunk has little to attend to and the late one much, so every rank
gets the same work). Tokens, labels, loss mask and position ids are split the same way, and rotary embeddings and
the attention mask use the tokens' *global* positions (:func:`cp_positions`)::

    cp 2, seq 8:   chunks  [0 1] [2 3] [4 5] [6 7]
                   rank 0:  [0 1]             [6 7]   positions 0 1 6 7
                   rank 1:        [2 3] [4 5]         positions 2 3 4 5

The loss is the mean over every unmasked token of the sequence, not a mean of per-rank means: each rank's masked
loss sum is divided by the count of the whole sequence (summed over cp), :func:`sequence_mean_loss`.
"""

from __future__ import annotations

import torch

from megatron_like import collectives as comm
from megatron_like.model.rotary import RopeScaling, sequence_rotary_tables
from megatron_like.parallel_state import ParallelState


def cp_chunk_ids(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two of the ``2 cp`` sequence chunks that cp rank ``cp_rank`` holds, in its local order."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def cp_positions(seq_length: int, cp_size: int, cp_rank: int, device: torch.device | None = None) -> torch.Tensor:
    """Global positions int64 ``[seq_length / cp]`` of the tokens cp rank ``cp_rank`` holds (``seq_length``: the
    whole sequence's)."""
    chunk = seq_length // (2 * cp_size)
    first, second = cp_chunk_ids(cp_size, cp_rank)
    return torch.cat([torch.arange(first * chunk, (first + 1) * chunk, device=device),
                      torch.arange(second * chunk, (second + 1) * chunk, device=device)])


def cp_rotary_tables(local_tokens: int, rotary_dim: int, base: float, scaling: RopeScaling | None,
                     ps: ParallelState, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[local_tokens, rotary_dim]`` at the global positions of this cp rank's ``local_tokens`` tokens
    (its two chunks of a sequence of ``local_tokens * cp``): rows of the whole sequence's tables, so RoPE scaling
    (YaRN's frequencies and attention factor included) is that of one process."""
    seq_length = local_tokens * ps.cp_size
    cos, sin = sequence_rotary_tables(seq_length, rotary_dim, base, device, scaling)
    positions = cp_positions(seq_length, ps.cp_size, ps.cp_rank, device)
    return cos[positions], sin[positions]


def split_for_context_parallel(tensor: torch.Tensor, cp_size: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This cp rank's two chunks of ``tensor`` along ``dim`` (the sequence): ``[.., s, ..]`` -> ``[.., s / cp, ..]``."""
    if cp_size == 1:
        return tensor
    if tensor.shape[dim] % (2 * cp_size) != 0:
        raise ValueError(f"a sequence of {tensor.shape[dim]} does not cut into 2 x {cp_size} chunks")
    chunks = tensor.chunk(2 * cp_size, dim=dim)
    first, second = cp_chunk_ids(cp_size, cp_rank)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def gather_sequence(local: torch.Tensor, ps: ParallelState, dim: int = 1) -> torch.Tensor:
    """The whole sequence ``[.., s, ..]`` in position order from every cp rank's two chunks ``[.., s / cp, ..]``
    along ``dim`` (the inverse of :func:`split_for_context_parallel`). For token ids and masks: no gradient flows
    back."""
    cp = ps.cp_size
    if cp == 1:
        return local
    pieces = comm.all_gather_along_dim(local, ps.cp_group, dim).chunk(2 * cp, dim=dim)  # rank r's two chunks
    ordered = [None] * (2 * cp)
    for rank in range(cp):
        for piece, chunk in zip(pieces[2 * rank:2 * rank + 2], cp_chunk_ids(cp, rank)):
            ordered[chunk] = piece
    return torch.cat(ordered, dim=dim)


def split_batch(batch: dict[str, torch.Tensor | None], ps: ParallelState) -> dict[str, torch.Tensor | None]:
    """Every ``[b, s]`` tensor of a GPT batch cut to this cp rank's ``[b, s / cp]`` (the same cut for all of them;
    None values stay None)."""
    if ps.cp_size == 1:
        return batch
    return {name: None if value is None else split_for_context_parallel(value, ps.cp_size, ps.cp_rank, dim=1)
            for name, value in batch.items()}


def sequence_mean_loss(per_token_loss: torch.Tensor, loss_mask: torch.Tensor, ps: ParallelState
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss to backpropagate, loss to report)`` of this rank's ``per_token_loss [b, s / cp]``.

    The reported loss is the masked mean over the whole sequence (every cp rank reports the same value). The
    backpropagated one is this rank's masked sum over the whole sequence's count, times cp: gradients are averaged
    over the dp x cp ranks (``distributed/buffers.py``), so the cp average of these is the gradient of the whole
    sequence's mean. A cp rank whose tokens are all masked contributes 0 (and so does a batch with no unmasked
    token at all: its count is taken as 1, never 0/0).
    """
    loss_sum = (per_token_loss.float() * loss_mask).sum()
    totals = torch.stack([loss_sum.detach(), loss_mask.sum().float()])
    comm.all_reduce(totals, ps.cp_group)
    count = totals[1].clamp(min=1.0)
    return loss_sum * (ps.cp_size / count), totals[0] / count
