"""Continuous batching on every rank of a model: admit new sequences, run one decoding step, apply rank 0's choices.

The server (``tools/text_generation_server.py``) keeps a :class:`BatchEngine` on every rank. Each iteration of
its loop rank 0 broadcasts a *plan* (:func:`megatron_like.inference.serving.broadcast_request`): the sequences
to admit (prompt ids, the slots of their ``n`` choices, whether their prompt is scored); then every rank runs
:meth:`BatchEngine.forward`:

1. the admitted prompts are prefilled together, one forward of them left padded to the longest (several forwards
   when their lengths differ so much that padding would more than double the work: :func:`prefill_groups`), each
   into its first slot (``SlotKVCache.begin`` with per-row counts), and copied to its other slots; a prompt whose
   log-probabilities are asked for (``echo`` with ``logprobs``) is also scored by a full forward
   (:func:`score_prompt`);
2. one decoding step of every slot that was already generating: its last token at its own position, attending
   to its own cache (:class:`~megatron_like.inference.slot_cache.SlotKVCache`). The generating slots are kept
   consecutive from 0 (:meth:`BatchEngine.commit` moves a sequence down when one below it ends), so the step
   reads their keys and values as one view.

Every rank ends with the same next-token logits ``[rows, vocab]``. Rank 0 alone chooses each row's token and
whether its sequence ended (``megatron_like/inference/scheduler.py``: sampling with a per-request generator,
stop strings, length limits) and broadcasts the choices, which every rank applies (:meth:`BatchEngine.commit`):
the ranks stay in lockstep whatever their float noise, and a request that joins is served at the next step
instead of after the whole batch. A failure while running the model, on any rank, is agreed by all ranks
(``collectives.first_error``) and ends every sequence in flight: rank 0 answers their clients 500 and the
engine starts empty. As for ``PUT /api`` (``serving.py``), the ranks agree twice: after each rank's own checks
of the plan (:meth:`BatchEngine.check`, no collectives: a failure of one rank alone is recovered) and after the
step, which recovers failures raised at the same point on every rank; a fault of one rank alone inside the
model's forward leaves the others in a collective until ``--distributed-timeout-minutes``.

Limits: prompts are not chunked: a step's prefill runs all its prompts whole before the running rows' decoding
step, padded to the longest (a burst of long prompts delays the running sequences by one forward of them); a
slot's cache holds at most the model's positions; ``--max-batch-size`` slots are allocated up front.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from megatron_like import collectives as comm
from megatron_like.inference.evaluation import pipelined_forward
from megatron_like.inference.generation import ModelRunner
from megatron_like.inference.loading import InferenceModel
from megatron_like.inference.packed_linear import ensure_packed
from megatron_like.inference.slot_cache import SlotKVCache

ENDED, FAILED = 1, 2
"""Values of the second column of rank 0's choices: the sequence ended after this token / its step failed."""


@dataclass
class Admission:
    """A prompt joining the batch: ``slots`` (one per choice), its ``ids``, ``top`` alternatives of the prompt's
    log-probabilities to score (None: not scored) and whether it generates (``max_tokens`` > 0)."""

    slots: list[int]
    ids: list[int]
    top: int | None = None
    generate: bool = True


@dataclass
class StepOutput:
    """What every rank knows after :meth:`BatchEngine.forward`."""

    rows: list[int] = field(default_factory=list)
    """The slot of each logits row."""
    logits: torch.Tensor | None = None
    """float32 ``[len(rows), vocab]``: the next-token logits of each row (None when no row generates)."""
    prompt_scores: list[torch.Tensor | None] = field(default_factory=list)
    """Per admission: float64 ``[len(ids) - 1, 1 + 2 top]`` (each token's log-probability, then the ``top`` best
    log-probabilities and their ids at its position), or None when not asked for."""


@torch.inference_mode()
def score_prompt(loaded: InferenceModel, ids: Sequence[int], top: int) -> torch.Tensor:
    """The log-probabilities of prompt ``ids`` under the model, on every rank (call on every rank).

    Returns float64 ``[len(ids) - 1, 1 + 2 top]``: for token ``i + 1``, its log-probability given ``ids[:i + 1]``,
    then the ``top`` highest log-probabilities at that position and their token ids. The softmax runs over the
    real vocabulary (no padding rows), as a Hugging Face model of the same weights.
    """
    chunk = loaded.model[0]
    ps = chunk.ps
    tokens = torch.tensor([list(ids)], dtype=torch.long, device=ps.device)
    rows = len(ids) - 1
    out = torch.zeros(rows, 1 + 2 * top, dtype=torch.float64, device=ps.device)
    logits = pipelined_forward(chunk, tokens)
    if logits is not None and rows > 0:
        logp = logits[0, :-1, : loaded.vocab_size].log_softmax(dim=-1)  # (L - 1, V)
        out[:, 0] = logp.gather(1, tokens[0, 1:, None]).squeeze(1)
        best = logp.topk(min(top, logp.shape[-1]), dim=-1)
        out[:, 1:1 + best.values.shape[1]] = best.values
        out[:, 1 + top:1 + top + best.values.shape[1]] = best.indices.double()
    if ps.pp_size > 1:  # the last stage computed it
        comm.broadcast(out, ps.pp_global_ranks[-1], ps.pp_group)
    return out


class BatchEngine:
    """The batched decoding state of this rank: a slot cache and each generating slot's last token.

    Args:
        loaded: this rank's model.
        slots: sequences decoded together at most.
    """

    def __init__(self, loaded: InferenceModel, slots: int) -> None:
        self.loaded, self.slots = loaded, slots
        self.runner = ModelRunner(loaded.model, loaded.vocab_size)
        self.device = self.runner.ps.device
        self.max_length = self.runner.max_positions
        for chunk in loaded.model:
            chunk.eval()
        self.reset()

    def reset(self) -> None:
        """Forget every sequence (after a failed step every rank does, so they agree again)."""
        self.cache = SlotKVCache(self.slots, self.max_length, self.device)
        self.last_token: dict[int, int] = {}
        """Generating slot -> the token its next decoding step feeds."""
        self.decode_steps = self.decoded_rows = 0
        """Decoding forwards run and the rows they decoded (their ratio is the mean batch)."""

    def _prefill(self, admissions: Sequence[Admission]) -> torch.Tensor:
        """One forward of every admitted prompt, left padded to the longest, into each one's first slot; returns the
        next-token logits ``[len(admissions), vocab]`` (each row's last column is its last prompt token)."""
        counts = [len(a.ids) for a in admissions]
        width = max(counts)
        positions = self.cache.begin([a.slots[0] for a in admissions], width, counts)
        # The pads' id is arbitrary: they are written after the row's real tokens, which never attend to them.
        tokens = torch.tensor([[0] * (width - len(a.ids)) + list(a.ids) for a in admissions], dtype=torch.long,
                              device=self.device)
        return self.runner(tokens, positions, self.cache)

    def check(self, admissions: Sequence[Admission]) -> None:
        """This rank's checks of a plan before any collective (ValueError/RuntimeError says what is wrong)."""
        for admission in admissions:
            busy = [s for s in admission.slots if s in self.last_token or self.cache.lengths[s]]
            if busy:
                raise RuntimeError(f"slot {busy[0]} is admitted while in use")
            if not admission.ids or any(not 0 <= t < self.loaded.vocab_size for t in admission.ids):
                raise ValueError(f"every prompt needs token ids in [0, {self.loaded.vocab_size})")
            if admission.generate and len(admission.ids) >= self.max_length:
                raise ValueError(f"a prompt of {len(admission.ids)} tokens leaves no room in the model's "
                                 f"{self.max_length} positions")

    @torch.inference_mode()
    def forward(self, admissions: Sequence[Admission]) -> StepOutput:
        """Prefill ``admissions``, then one decoding step of the slots already generating (call on every rank)."""
        out = StepOutput()
        # Packed for 2 rows or more, one prepacked weight serves every row count; a PUT /api request in between may
        # have packed the weights for its own batch (a no-op when nothing changed).
        ensure_packed(self.loaded.model, max(2, self.slots))
        decoding = sorted(self.last_token)
        pieces = []
        for admission in admissions:
            out.prompt_scores.append(score_prompt(self.loaded, admission.ids, admission.top)
                                     if admission.top is not None else None)
        for group in prefill_groups([a for a in admissions if a.generate]):
            logits = self._prefill(group)
            for row, admission in enumerate(group):
                for slot in admission.slots[1:]:
                    self.cache.copy_slot(admission.slots[0], slot)
                pieces.append(logits[row:row + 1].expand(len(admission.slots), -1))
                out.rows += admission.slots
        if decoding:
            positions = self.cache.begin(decoding, 1)
            tokens = torch.tensor([[self.last_token[s]] for s in decoding], dtype=torch.long, device=self.device)
            pieces.append(self.runner(tokens, positions, self.cache))
            out.rows += decoding
            self.decode_steps, self.decoded_rows = self.decode_steps + 1, self.decoded_rows + len(decoding)
        if pieces:
            out.logits = torch.cat(pieces)
        return out

    @torch.inference_mode()
    def commit(self, rows: Sequence[int], choices: torch.Tensor) -> dict[int, int]:
        """Apply rank 0's ``choices`` (long ``[len(rows), 2]``: token, ENDED/FAILED flag) to ``rows``' slots, then
        keep the running sequences in slots ``0 .. k - 1``: each of the highest ones moves into a free slot below
        (its cached tokens copied once), so the next decoding step reads the rows' keys and values as one view
        rather than gathering them in every layer. Returns the moves ``{old slot: new slot}``, the same on every
        rank (they follow from the choices)."""
        for slot, (token, flag) in zip(rows, choices.tolist()):
            if flag in (ENDED, FAILED):
                self.release(slot)
            else:
                self.last_token[slot] = token
        running = len(self.last_token)
        holes = [slot for slot in range(running) if slot not in self.last_token]
        above = sorted((slot for slot in self.last_token if slot >= running), reverse=True)
        moves = dict(zip(above, holes))
        for old, new in moves.items():
            self.cache.copy_slot(old, new)
            self.cache.release(old)
            self.last_token[new] = self.last_token.pop(old)
        return moves

    @torch.inference_mode()
    def release(self, slot: int) -> None:
        """The sequence in ``slot`` ended: free the slot."""
        self.last_token.pop(slot, None)
        self.cache.release(slot)


def prefill_groups(admissions: Sequence[Admission]) -> list[list[Admission]]:
    """``admissions`` split into the prompts of each prefill forward: longest first, a prompt joins the current
    forward while the padded tokens stay within twice the real ones (so 16 prompts of similar lengths are one
    forward, and a long prompt does not make fifteen short ones cost its length each)."""
    groups: list[list[Admission]] = []
    real = 0
    for admission in sorted(admissions, key=lambda a: -len(a.ids)):
        width = len(groups[-1][0].ids) if groups else 0
        if groups and (len(groups[-1]) + 1) * width <= 2 * (real + len(admission.ids)):
            groups[-1].append(admission)
            real += len(admission.ids)
        else:
            groups.append([admission])
            real = len(admission.ids)
    return groups


def broadcast_choices(choices: torch.Tensor | None, rows: int, device: torch.device) -> torch.Tensor:
    """Rank 0's ``choices`` (long ``[rows, 2]``) on every rank of the world."""
    if choices is None:
        choices = torch.zeros(rows, 2, dtype=torch.long, device=device)
    choices = choices.to(device).contiguous()  # a collective sends the storage as it lies
    group = comm.world_group()
    if group is not None and rows:
        comm.broadcast(choices, 0, group)
    return choices
