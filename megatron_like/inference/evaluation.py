"""Zero-shot evaluation as Megatron's ``tasks/zeroshot_gpt``: sliding-window perplexity (WikiText-103
style, with the word-adjusted perplexity) and LAMBADA-style last-word accuracy.

Works under tensor, pipeline and data parallelism: each rank runs its chunk, hidden states ``[s, b, h]``
go stage to stage, the last stage computes the (vocabulary-parallel) loss or gathered logits. With
``dp`` model replicas, replica ``r`` takes batches ``r, r + dp, ...``; the sums are added over the
replicas and broadcast over the pipeline, so every rank returns the same numbers. An MoE model whose experts
are split over ``ep`` ranks is one replica of ``ep`` data-parallel ranks (they see the same batches, which the
token dispatcher shares out to the experts): ``dp / ep`` replicas, numbered by the expert-dp rank.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_like import collectives as comm
from megatron_like.model.gpt import GPTModel
from megatron_like.tensor_parallel import gather_from_tensor_parallel_region


@torch.inference_mode()
def pipelined_forward(chunk: GPTModel, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor | None:
    """Run ``tokens [b, s]`` through every stage: per-token loss ``[b, s]`` (with ``labels``) or full logits
    ``[b, s, v_padded]`` (gathered over tp) on the last stage; None on the others."""
    ps = chunk.ps
    b, s = tokens.shape
    positions = torch.arange(s, device=tokens.device)[None].expand(b, -1)
    hidden = None
    if not chunk.pre_process:
        dtype = next(chunk.parameters()).dtype
        hidden = torch.empty(s, b, chunk.config.hidden_size, dtype=dtype, device=ps.device)
        comm.exchange([], [(hidden, ps.pp_neighbor(-1))])
    out = chunk(tokens, positions, labels=labels if chunk.post_process else None, hidden_states=hidden)
    if not chunk.post_process:
        comm.exchange([(out.contiguous(), ps.pp_neighbor(1))], [])
        return None
    return out.float() if labels is not None else gather_from_tensor_parallel_region(out, ps.tp_group).float()


def _batch_starts(chunk: GPTModel, num_items: int, batch_size: int) -> range:
    """The first item of each batch this replica evaluates (every ``dp / ep``-th batch)."""
    ps = chunk.ps
    return range(ps.expert_dp_rank * batch_size, num_items, batch_size * ps.expert_dp_size)


def _summed_over_replicas(chunk: GPTModel, values: Sequence[float]) -> list[float]:
    """Add a few numbers over the replicas and broadcast them from the last pipeline stage to every stage
    (other stages hold zeros). The replicas are the ranks holding the same experts (all dp ranks at ep 1)."""
    ps = chunk.ps
    tensor = torch.tensor(list(values), dtype=torch.float64, device=ps.device)  # NCCL takes device tensors only
    if ps.expert_dp_group is not None:
        comm.all_reduce(tensor, ps.expert_dp_group)
    if ps.pp_size > 1:
        comm.broadcast(tensor, ps.pp_global_ranks[-1], ps.pp_group)
    return tensor.tolist()


# --------------------------------------------------------------------------------------------------
# Sliding-window perplexity
# --------------------------------------------------------------------------------------------------


def sliding_windows(num_tokens: int, seq_length: int, stride: int) -> list[tuple[int, int, int]]:
    """``(start, end, first_scored)`` windows over a token stream (Megatron's overlapping eval).

    Window ``i`` feeds tokens ``[start, end)`` and predicts ``[start + 1, end + 1)``; only targets from
    ``first_scored`` on count (every window but the first is context except its last ``stride``
    targets), so each of the ``num_tokens - 1`` targets is scored exactly once.
    """
    if num_tokens < 2:
        raise ValueError("perplexity needs at least two tokens")
    if not 0 < stride <= seq_length:
        raise ValueError(f"--overlapping-eval {stride} must be in [1, --seq-length {seq_length}]")
    start, end, first = 0, min(seq_length, num_tokens - 1), 1
    windows = [(start, end, first)]
    while end < num_tokens - 1:
        first = end + 1
        end = min(end + stride, num_tokens - 1)
        start = max(end - seq_length, 0)
        windows.append((start, end, first))
    return windows


@dataclass
class PerplexityResult:
    avg_loss: float
    ppl: float
    adjusted_ppl: float
    num_tokens: int
    num_words: int

    def line(self, task: str) -> str:
        """Megatron's result line."""
        ratio = (self.num_tokens - 1) / max(self.num_words - 1, 1)
        return (f" validation results on {task} | avg loss: {self.avg_loss:.4E} | ppl: {self.ppl:.4E} | "
                f"adjusted ppl: {self.adjusted_ppl:.4E} | token ratio: {ratio} |")


def perplexity(chunk: GPTModel, tokens: Sequence[int], num_words: int, seq_length: int, stride: int,
               vocab_size: int, batch_size: int = 4, progress: Iterator | None = None) -> PerplexityResult:
    """Token and word-adjusted perplexity of a token stream with sliding windows of ``seq_length``.

    The softmax runs over the real ``vocab_size`` ids: the padding rows of the output layer are not
    tokens and take no probability mass (as in a Hugging Face model of the same weights).
    """
    stream = torch.tensor(list(tokens), dtype=torch.long)
    windows = sliding_windows(len(stream), seq_length, stride)
    total = 0.0
    for i in _batch_starts(chunk, len(windows), batch_size):
        group = windows[i:i + batch_size]
        inputs = torch.zeros(len(group), seq_length, dtype=torch.long)
        labels = torch.zeros_like(inputs)
        mask = torch.zeros(len(group), seq_length)
        for row, (start, end, first) in enumerate(group):
            inputs[row, : end - start] = stream[start:end]
            labels[row, : end - start] = stream[start + 1:end + 1]
            mask[row, first - 1 - start: end - start] = 1.0
        logits = pipelined_forward(chunk, inputs.to(chunk.ps.device))
        if logits is not None:
            loss = F.cross_entropy(logits[..., :vocab_size].flatten(0, 1).cpu(), labels.flatten(), reduction="none")
            total += float((loss.view_as(mask) * mask).sum())
        if progress is not None:
            next(progress, None)
    (total,) = _summed_over_replicas(chunk, [total])
    targets = len(stream) - 1
    return PerplexityResult(total / targets, math.exp(min(total / targets, 700)),
                            math.exp(min(total / max(num_words - 1, 1), 700)), len(stream), num_words)


# --------------------------------------------------------------------------------------------------
# LAMBADA
# --------------------------------------------------------------------------------------------------


def lambada_example(tokenizer, text: str, strict: bool) -> tuple[list[int], list[int]]:
    """(context ids, target ids): the last word (strict) or the last token of ``text`` (Megatron's rule)."""
    text = text.strip()
    if not strict:
        ids = tokenizer.tokenize(text)
        return ids[:-1], ids[-1:]
    cut = text.rfind(" ")
    if cut <= 0:
        raise ValueError(f"LAMBADA text needs a space before its last word: {text[:60]!r}")
    return tokenizer.tokenize(text[:cut]), tokenizer.tokenize(text[cut:])


def lambada_accuracy(chunk: GPTModel, examples: Sequence[tuple[list[int], list[int]]], vocab_size: int,
                     batch_size: int = 4, progress: Iterator | None = None) -> tuple[float, int]:
    """(accuracy, count): an example is right when greedy predicts every target token (teacher forced)."""
    seq_limit = chunk.config.max_positions
    correct = 0
    for i in _batch_starts(chunk, len(examples), batch_size):
        group = examples[i:i + batch_size]
        rows = [(ctx + tgt)[-(seq_limit + 1):] for ctx, tgt in group]
        length = max(len(r) for r in rows) - 1
        inputs = torch.zeros(len(rows), length, dtype=torch.long)
        for r, ids in enumerate(rows):
            inputs[r, : len(ids) - 1] = torch.tensor(ids[:-1])
        logits = pipelined_forward(chunk, inputs.to(chunk.ps.device))
        if logits is not None:
            predicted = logits[..., :vocab_size].argmax(-1).cpu()
            for r, ((_, target), ids) in enumerate(zip(group, rows)):
                end = len(ids) - 1
                correct += int(predicted[r, end - len(target):end].tolist() == list(target))
        if progress is not None:
            next(progress, None)
    (correct,) = _summed_over_replicas(chunk, [correct])
    return correct / max(len(examples), 1), len(examples)
