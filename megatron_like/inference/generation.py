"""Text generation: greedy, sampling (temperature, top-k, top-p) and beam search, with a KV cache.

Works on the GPT chunk(s) of this rank under any tensor/pipeline layout: every rank of the model runs
the same loop; the last pipeline stage gathers the vocabulary-parallel logits of the *last position
only* over tp and broadcasts them over pp (and, for an MoE model split over ep ranks, over ep), so every rank
takes identical decisions.

Batches of prompts of different lengths are left padded (the KV cache masks the padding and each row's
positions start at 0 at its first real token), so the next token of every row is at the same column.
Decisions follow Hugging Face ``generate`` (same order of logits processors, same beam search
bookkeeping), so greedy and beam search give its tokens on converted weights.

    params = GenerationParams(max_new_tokens=32, do_sample=True, top_p=0.9, seed=1)
    outputs = generate(model, [[464, 2068], [15496]], params, eod=tokenizer.eod)
    outputs[0][0].token_ids   # new tokens of prompt 0, first returned sequence
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_like import collectives as comm
from megatron_like.inference.kv_cache import KVCache
from megatron_like.model.gpt import GPTModel
from megatron_like.tensor_parallel import gather_from_tensor_parallel_region

NEG_INF = float("-inf")
_BEAM_NEG = -1.0e9  # "impossible" score of Hugging Face's beam search (finite, so it still sorts)


@dataclass
class GenerationParams:
    """What to generate. Sampling processors apply in Hugging Face's order: temperature, top-k, top-p."""

    max_new_tokens: int = 32
    """Tokens to generate at most per sequence."""
    min_new_tokens: int = 0
    """End-of-text is forbidden before this many new tokens."""
    do_sample: bool = False
    """Sample from the processed distribution; False = greedy (or beam search with num_beams > 1)."""
    temperature: float = 1.0
    """Divide the logits by this before sampling."""
    top_k: int = 0
    """Sample among the k most likely tokens only (0 = all)."""
    top_p: float = 1.0
    """Sample among the smallest set of tokens whose probability reaches p (1.0 = all)."""
    num_return_sequences: int = 1
    """Sequences returned per prompt (independent samples, or the best beams)."""
    num_beams: int = 1
    """Beam search with this many beams when > 1."""
    length_penalty: float = 1.0
    """Beam score = sum of log-probs / generated length ** length_penalty."""
    early_stopping: bool | str = False
    """Beam search: True stops when num_beams hypotheses are done; False uses HF's heuristic; 'never'."""
    seed: int | None = None
    """Seed of the sampling generator (every rank uses the same one)."""
    use_cache: bool = True
    """Reuse keys and values of earlier positions; False recomputes the whole sequence each step."""
    cache_latent: bool = True
    """Multi-latent attention layers cache their compressed latent and decode with absorbed up-projections;
    False: they cache full keys and values (the reference path)."""

    def validate(self) -> GenerationParams:
        """Raise ValueError naming the first invalid field."""
        checks = [
            (self.max_new_tokens >= 1, f"max_new_tokens {self.max_new_tokens} must be >= 1"),
            (0 <= self.min_new_tokens <= self.max_new_tokens,
             f"min_new_tokens {self.min_new_tokens} must be in [0, max_new_tokens {self.max_new_tokens}]"),
            (self.temperature > 0 and math.isfinite(self.temperature),
             f"temperature {self.temperature} must be a finite number > 0"),
            (self.top_k >= 0, f"top_k {self.top_k} must be >= 0"),
            (0.0 < self.top_p <= 1.0, f"top_p {self.top_p} must be in (0, 1]"),
            (self.num_beams >= 1, f"num_beams {self.num_beams} must be >= 1"),
            (self.num_return_sequences >= 1, f"num_return_sequences {self.num_return_sequences} must be >= 1"),
            (math.isfinite(self.length_penalty), f"length_penalty {self.length_penalty} must be finite"),
            (self.early_stopping in (True, False, "never"), f"early_stopping {self.early_stopping!r} must be "
             "True, False or 'never'"),
        ]
        if self.num_beams > 1:
            checks += [
                (not self.do_sample, "beam search is deterministic: do_sample must be False with num_beams > 1"),
                (self.num_return_sequences <= self.num_beams,
                 f"num_return_sequences {self.num_return_sequences} must be <= num_beams {self.num_beams}"),
            ]
        elif not self.do_sample:
            checks.append((self.num_return_sequences == 1,
                           "greedy decoding returns one sequence: num_return_sequences must be 1 (or sample)"))
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        return self


@dataclass
class Generation:
    """One generated sequence: its new tokens (ending with end-of-text when it stopped there)."""

    token_ids: list[int]
    score: float | None = None
    """Beam search: the length-penalized score; greedy/sampling: the sum of log-probs of the new tokens."""


# --------------------------------------------------------------------------------------------------
# Running the model
# --------------------------------------------------------------------------------------------------


class ModelRunner:
    """Runs this rank's GPT chunk for generation and returns next-token logits on *every* rank.

    Args:
        model: the chunk(s) of this rank; exactly one (no virtual pipeline stages in generation).
        vocab_size: the real (unpadded) vocabulary; logits of padding ids are dropped.
    """

    def __init__(self, model: Sequence[GPTModel], vocab_size: int | None = None) -> None:
        if len(model) != 1:
            raise ValueError("generation needs one model chunk per rank (no --num-layers-per-virtual-pipeline-stage)")
        self.chunk = model[0]
        self.ps = self.chunk.ps
        self.vocab_size = vocab_size or self.chunk.vocab_size
        if self.vocab_size > self.chunk.vocab_size:
            raise ValueError(f"vocabulary {self.vocab_size} is larger than the model's {self.chunk.vocab_size}")
        self.max_positions = self.chunk.config.max_positions
        self.hidden_size = self.chunk.config.hidden_size
        self.dtype = next(self.chunk.parameters()).dtype

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Logits ``[b, vocab]`` (float32) of the token after ``tokens [b, s]`` at ``positions [b, s]``.

        The new tokens' keys and values are appended to ``cache``.
        """
        chunk, ps = self.chunk, self.ps
        b, s = tokens.shape
        hidden = None
        if not chunk.pre_process:
            hidden = torch.empty(s, b, self.hidden_size, dtype=self.dtype, device=ps.device)
            comm.exchange([], [(hidden, ps.pp_neighbor(-1))])
        out = chunk(tokens, positions, hidden_states=hidden, inference_context=cache)
        cache.advance(s)
        if chunk.post_process:
            logits = gather_from_tensor_parallel_region(out[:, -1], ps.tp_group)  # (b, v_padded)
            logits = logits[:, : self.vocab_size].float().contiguous()
        else:
            comm.exchange([(out.contiguous(), ps.pp_neighbor(1))], [])
            logits = torch.empty(b, self.vocab_size, dtype=torch.float32, device=ps.device)
        if ps.pp_size > 1:
            comm.broadcast(logits, ps.pp_global_ranks[-1], ps.pp_group)
        if ps.ep_size > 1:  # MoE: the ep ranks replicate all but the experts; one set of logits, whatever the noise
            comm.broadcast(logits, ps.expert_rank_of(ps.etp_rank, 0, ps.expert_dp_rank, ps.pp_rank), ps.ep_group)
        return logits


class _Batch:
    """Left-padded token buffer ``[b, max_length]`` with positions and the KV cache of one generation."""

    def __init__(self, runner: ModelRunner, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 pad_id: int, use_cache: bool, cache_latent: bool = True) -> None:
        device = runner.ps.device
        self.runner, self.use_cache, self.cache_latent = runner, use_cache, cache_latent
        self.prompt_length = max(len(p) for p in prompts)
        self.max_length = self.prompt_length + max_new_tokens
        if self.max_length > runner.max_positions:
            raise ValueError(
                f"longest prompt ({self.prompt_length} tokens) + max_new_tokens {max_new_tokens} = "
                f"{self.max_length} exceeds the model's {runner.max_positions} positions "
                "(--max-position-embeddings)"
            )
        b = len(prompts)
        self.tokens = torch.full((b, self.max_length), pad_id, dtype=torch.long, device=device)
        valid = torch.ones(b, self.max_length, dtype=torch.bool, device=device)
        for row, prompt in enumerate(prompts):
            pad = self.prompt_length - len(prompt)
            self.tokens[row, pad:self.prompt_length] = torch.tensor(list(prompt), dtype=torch.long)
            valid[row, :pad] = False
        self.positions = (valid.long().cumsum(1) - 1).clamp(min=0)
        self.valid = None if bool(valid.all()) else valid
        self.cache = KVCache(b, self.max_length, self.valid, cache_latent)
        self.filled = 0  # columns whose keys/values are in the cache

    def next_logits(self, length: int) -> torch.Tensor:
        """Logits ``[b, vocab]`` of the token at column ``length`` given columns ``[0, length)``."""
        if not self.use_cache:  # recompute everything: the reference the cache must agree with
            self.cache, self.filled = KVCache(self.tokens.shape[0], self.max_length, self.valid, self.cache_latent), 0
        start, self.filled = self.filled, length
        return self.runner(self.tokens[:, start:length], self.positions[:, start:length], self.cache)

    def reorder(self, rows: torch.Tensor) -> None:
        """Keep rows ``rows`` (beam search)."""
        self.tokens = self.tokens.index_select(0, rows)
        self.positions = self.positions.index_select(0, rows)
        if self.valid is not None:
            self.valid = self.valid.index_select(0, rows)
        self.cache.reorder(rows)


# --------------------------------------------------------------------------------------------------
# Logits processors (Hugging Face's semantics)
# --------------------------------------------------------------------------------------------------


def process_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus) filtering of ``logits [b, v]``; removed ids get -inf.

    Any temperature > 0 is numerically safe: a row whose ``logits / temperature`` would overflow (a tiny
    temperature) is first shifted so its maximum is 0 and divided by at least the smallest normal float, so
    the best token keeps 0 and the others go to a large negative number or -inf (the limit of sampling as
    the temperature goes to 0: greedy among tied maxima). Otherwise the values are Hugging Face's
    ``logits / temperature`` exactly. Every step is per row, so a row's values do not depend on the
    other rows (the server processes the rows of one setting together).
    """
    if temperature != 1.0:
        scaled = logits / temperature
        overflows = (torch.isfinite(logits) & ~torch.isfinite(scaled)).any(dim=-1, keepdim=True)  # (b, 1)
        if bool(overflows.any()):
            top = logits.amax(dim=-1, keepdim=True)
            top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # a row of -inf stays -inf
            scaled = torch.where(overflows, (logits - top) / max(temperature, torch.finfo(logits.dtype).tiny), scaled)
        logits = scaled
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, NEG_INF)
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= 1 - top_p
        remove[:, -1] = False  # always keep the most likely token
        logits = logits.masked_fill(remove.scatter(1, order, remove), NEG_INF)
    return logits


def _shared_random_seed(ps) -> int:
    """A fresh seed, the same on every rank of the model (all must sample identically)."""
    seed = torch.tensor([torch.seed() % 2**62], dtype=torch.long, device=ps.device)  # NCCL: device tensors only
    if ps.ep_size > 1:  # the model's experts span its ep ranks, which run the same tokens (loading.py): all ranks
        comm.broadcast(seed, 0, comm.world_group())
    elif ps.model_parallel_group is not None:
        comm.broadcast(seed, ps.rank_of(0, ps.dp_rank, 0), ps.model_parallel_group)
    return int(seed)


def _forbid_eod(logits: torch.Tensor, eod: int | None, step: int, min_new_tokens: int) -> torch.Tensor:
    if eod is not None and step < min_new_tokens:
        logits = logits.clone()
        logits[:, eod] = NEG_INF
    return logits


# --------------------------------------------------------------------------------------------------
# Greedy and sampling
# --------------------------------------------------------------------------------------------------


def _greedy_or_sample(runner: ModelRunner, prompts: Sequence[Sequence[int]], params: GenerationParams,
                      eod: int | None) -> list[Generation]:
    """One Generation per row of ``prompts`` (already repeated for num_return_sequences)."""
    batch = _Batch(runner, prompts, params.max_new_tokens, eod if eod is not None else 0, params.use_cache,
                   params.cache_latent)
    b, start = len(prompts), batch.prompt_length
    generator = None
    if params.do_sample:
        generator = torch.Generator(device=runner.ps.device)
        generator.manual_seed(params.seed if params.seed is not None else _shared_random_seed(runner.ps))
    done = torch.zeros(b, dtype=torch.bool, device=runner.ps.device)
    lengths = torch.full((b,), params.max_new_tokens, dtype=torch.long)
    scores = torch.zeros(b, dtype=torch.float32, device=runner.ps.device)
    for step in range(params.max_new_tokens):
        logits = _forbid_eod(batch.next_logits(start + step), eod, step, params.min_new_tokens)
        if params.do_sample:
            logits = process_logits(logits, params.temperature, params.top_k, params.top_p)
            next_tokens = torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(1)
        else:
            next_tokens = logits.max(dim=-1).indices  # the first maximum, as argmax; 3x faster on CPU
        token_logp = logits.log_softmax(dim=-1).gather(1, next_tokens[:, None]).squeeze(1)
        scores += torch.where(done, 0.0, token_logp)
        if eod is not None:
            next_tokens = torch.where(done, eod, next_tokens)
        if runner.ps.tp_size > 1:  # one decision for the whole tp group, whatever the float noise
            comm.broadcast(next_tokens, runner.ps.tp_global_ranks[0], runner.ps.tp_group)
        batch.tokens[:, start + step] = next_tokens
        if eod is not None:
            finished_now = (next_tokens == eod) & ~done
            lengths[finished_now.cpu()] = step + 1
            done |= finished_now
            if bool(done.all()):
                break
    generated = batch.tokens[:, start:].cpu()
    return [Generation(generated[r, : int(lengths[r])].tolist(), float(scores[r])) for r in range(b)]


# --------------------------------------------------------------------------------------------------
# Beam search (Hugging Face's bookkeeping, vectorized over the batch)
# --------------------------------------------------------------------------------------------------


def _beam_search(runner: ModelRunner, prompts: Sequence[Sequence[int]], params: GenerationParams,
                 eod: int | None) -> list[list[Generation]]:
    """The ``num_return_sequences`` best finished hypotheses of each prompt, best first."""
    nb, max_new, lp = params.num_beams, params.max_new_tokens, params.length_penalty
    n_prompts, device = len(prompts), runner.ps.device
    batch = _Batch(runner, [p for p in prompts for _ in range(nb)], max_new, eod if eod is not None else 0,
                   params.use_cache, params.cache_latent)
    start, vocab = batch.prompt_length, runner.vocab_size
    keep = 2 * nb  # candidates per prompt: enough to still have nb running ones if nb of them end
    in_top_nb = torch.arange(keep, device=device) < nb
    fill = eod if eod is not None else 0

    running_scores = torch.zeros(n_prompts, nb, device=device)
    running_scores[:, 1:] = _BEAM_NEG  # all beams start equal: let only beam 0 expand at step 0
    running_seqs = torch.full((n_prompts, nb, max_new), fill, dtype=torch.long, device=device)
    done_seqs = running_seqs.clone()
    done_scores = torch.full((n_prompts, nb), _BEAM_NEG, device=device)
    done_lengths = torch.zeros(n_prompts, nb, dtype=torch.long, device=device)
    done_flags = torch.zeros(n_prompts, nb, dtype=torch.bool, device=device)
    may_improve = torch.ones(n_prompts, 1, dtype=torch.bool, device=device)
    prompt_offset = torch.arange(n_prompts, device=device)[:, None] * nb

    for step in range(max_new):
        logp = batch.next_logits(start + step).log_softmax(dim=-1)
        logp = _forbid_eod(logp, eod, step, params.min_new_tokens)
        logp = logp.view(n_prompts, nb, vocab) + running_scores[:, :, None]
        cand_scores, cand_index = torch.topk(logp.view(n_prompts, nb * vocab), keep, dim=-1)  # (n, 2nb)
        cand_beam, cand_token = cand_index // vocab, cand_index % vocab
        cand_seqs = running_seqs.gather(1, cand_beam[:, :, None].expand(-1, -1, max_new)).clone()
        cand_seqs[:, :, step] = cand_token
        ends = (cand_token == eod) if eod is not None else torch.zeros_like(cand_token, dtype=torch.bool)
        ends = ends | (step + 1 >= max_new)

        # The nb best candidates that go on.
        next_pick = torch.topk(cand_scores + ends.float() * _BEAM_NEG, nb, dim=-1).indices
        running_scores = (cand_scores + ends.float() * _BEAM_NEG).gather(1, next_pick)
        running_seqs = cand_seqs.gather(1, next_pick[:, :, None].expand(-1, -1, max_new))
        source_beam = cand_beam.gather(1, next_pick)

        # Candidates among the top nb that ended join the finished hypotheses if they rank.
        just_done = ends & in_top_nb[None, :]
        final = cand_scores / float(step + 1) ** lp
        if params.early_stopping is True:
            final = final + (done_flags.all(1, keepdim=True)).float() * _BEAM_NEG
        final = final + (~may_improve).float() * _BEAM_NEG + (~just_done).float() * _BEAM_NEG
        merged = torch.topk(torch.cat([done_scores, final], 1), nb, dim=-1).indices
        done_scores = torch.cat([done_scores, final], 1).gather(1, merged)
        done_seqs = torch.cat([done_seqs, cand_seqs], 1).gather(1, merged[:, :, None].expand(-1, -1, max_new))
        step_lengths = torch.full_like(cand_token, step + 1)
        done_lengths = torch.cat([done_lengths, step_lengths], 1).gather(1, merged)
        done_flags = torch.cat([done_flags, just_done], 1).gather(1, merged)

        # Can a running beam still beat the worst finished one? (HF's heuristic)
        length = max_new if params.early_stopping == "never" and lp > 0 else step + 1
        best_running = running_scores[:, :1] / float(length) ** lp
        worst_done = torch.where(done_flags, done_scores.min(1, keepdim=True).values, _BEAM_NEG)
        may_improve = may_improve & (best_running > worst_done).any(-1, keepdim=True)
        all_done_early = bool(done_flags.all()) and params.early_stopping is True
        if not bool(may_improve.any()) or all_done_early or bool(ends.all()):
            break
        batch.reorder((prompt_offset + source_beam).view(-1))
        batch.tokens[:, start + step] = running_seqs[:, :, step].reshape(-1)

    results = []
    for i in range(n_prompts):
        results.append([
            Generation(done_seqs[i, j, : int(done_lengths[i, j])].tolist(), float(done_scores[i, j]))
            for j in range(params.num_return_sequences)
        ])
    return results


# --------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------


def generate(model: Sequence[GPTModel] | GPTModel, prompts: Sequence[Sequence[int]], params: GenerationParams,
             *, eod: int | None = None, vocab_size: int | None = None) -> list[list[Generation]]:
    """Generate continuations of ``prompts`` (token ids); call it on every rank of the model.

    Args:
        model: this rank's chunk (or a one-element list of it), in eval mode.
        prompts: one list of token ids per prompt (lengths may differ).
        eod: end-of-text id: a sequence stops after it (None: always generate ``max_new_tokens``).
        vocab_size: the real vocabulary (ids beyond it, the padding rows, are never generated).
    Returns:
        per prompt, ``params.num_return_sequences`` Generations (beams best first).
    """
    params.validate()
    model = [model] if isinstance(model, GPTModel) else list(model)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    runner = ModelRunner(model, vocab_size)
    bad = [t for p in prompts for t in p if not 0 <= t < runner.vocab_size]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {runner.vocab_size})")
    for chunk in model:
        chunk.eval()
    if params.num_beams > 1:
        return _beam_search(runner, prompts, params, eod)
    n = params.num_return_sequences
    rows = _greedy_or_sample(runner, [p for p in prompts for _ in range(n)], params, eod)
    return [rows[i * n:(i + 1) * n] for i in range(len(prompts))]
