"""Rank 0's side of continuous batching: the bounded queue of requests, slot assignment, and each token's choice.

HTTP handler threads turn a request into :class:`Job` s (one per prompt, each with ``n`` :class:`Choice` s) and
:meth:`Scheduler.submit` them; a full queue raises :class:`QueueFullError` (the server answers 503). One engine thread
runs :meth:`Scheduler.run` (rank 0's half of the loop in ``batching.py``): it admits waiting jobs while free
slots remain, broadcasts the plan, runs the engine step, chooses every row's token and broadcasts the choices,
and wakes the jobs that changed (their ``events`` queues: a streaming handler sends each new piece of text as
it comes, the others wait for the end).

Each choice samples with its own ``torch.Generator`` seeded from the request's ``seed`` (``seed + choice
index``): the rows of one sampling setting are processed together, and each row's token is drawn by inverse CDF
from one uniform of its own generator, so its tokens do not depend on which other requests share the batch;
without a seed the generator takes a fresh random one. ``temperature == 0`` is greedy. The reported
log-probabilities are the model's (before temperature, top-k and top-p), as OpenAI's.
"""

from __future__ import annotations

import queue
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from megatron_like import collectives as comm
from megatron_like.inference.batching import ENDED, FAILED, Admission, BatchEngine, StepOutput, broadcast_choices
from megatron_like.inference.detokenize import IncrementalText, first_stop
from megatron_like.inference.generation import process_logits
from megatron_like.inference.loading import InferenceModel
from megatron_like.inference.serving import Outcome, attempt, broadcast_request, serve_request


class QueueFullError(RuntimeError):
    """The bounded queue of waiting requests is full (answered 503)."""


@dataclass
class Sampling:
    """How one prompt's continuations are chosen (OpenAI's fields)."""

    max_tokens: int = 16
    """Tokens to generate at most per choice (0: only score the prompt, with ``echo``)."""
    temperature: float = 1.0
    """0 = greedy; else divide the logits by it before sampling."""
    top_p: float = 1.0
    """Sample among the smallest set of tokens whose probability reaches it."""
    top_k: int = 0
    """Sample among the k most likely tokens (0 = all)."""
    n: int = 1
    """Choices per prompt."""
    stop: list[str] = field(default_factory=list)
    """A choice ends before the first of these strings it generates."""
    seed: int | None = None
    """Seed of the choices' generators (choice i: seed + i); None = random."""
    logprobs: int | None = None
    """Report each token's log-probability and this many alternatives (None: no log-probabilities)."""
    echo: bool = False
    """The answer repeats the prompt (and its log-probabilities, with ``logprobs``)."""


@dataclass
class Choice:
    """One continuation being generated (rank 0's record)."""

    index: int
    generator: torch.Generator | None = None
    slot: int | None = None
    tokens: list[int] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    text: str = ""
    """The answer's text so far (cut before a stop string)."""
    decoded: IncrementalText | None = None
    """The text of ``tokens`` (end of text excluded), decoded a few tokens at a time."""
    searched: int = 0
    """Characters of the decoded text searched for stop strings and final (``first_stop``'s ``start``)."""
    sent: int = 0
    """Characters of ``text`` already streamed."""
    sent_tokens: int = 0
    """Tokens whose log-probabilities were already streamed."""
    closed: bool = False
    """Its last streamed event (with the finish reason) was sent."""
    finish_reason: str | None = None


@dataclass
class Job:
    """One prompt of a request and its choices; ``events`` gets ``"done"`` once every choice ended (or failed: then
    ``error`` is set) and, for a streamed job, ``"update"`` after each step that changed it."""

    ids: list[int]
    sampling: Sampling
    first_index: int = 0
    """Index of this prompt's first choice in the answer (prompt i of a list: i * n)."""
    choices: list[Choice] = field(default_factory=list)
    prompt_scores: torch.Tensor | None = None
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    """Its handler's wake-ups (SimpleQueue: a put is one C call, where ``queue.Queue``'s takes a Python lock and
    condition, on the engine thread, for every job at every step)."""
    error: tuple[int, str] | None = None
    cancelled: bool = False
    """Its client left (:meth:`Scheduler.cancel`): its slots are freed at the next step, nothing more is generated."""
    streamed: bool = False
    """Its handler streams the text as it comes: wake it after every step (a plain answer waits for ``"done"`` only,
    so its handler thread does not wake, and take the GIL from the engine thread, at every step)."""

    def __post_init__(self) -> None:
        self.choices = [Choice(self.first_index + i) for i in range(self.sampling.n)]

    @property
    def done(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)


@dataclass
class LegacyJob:
    """A ``PUT /api`` request: served whole by ``serving.serve_request`` between two batched steps."""

    request: dict
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    outcome: object = None


class Scheduler:
    """Rank 0: the queue and the engine loop. ``detokenize`` maps ids to text (as the answer shows them)."""

    def __init__(self, loaded: InferenceModel, engine: BatchEngine, detokenize: Callable[[list[int]], str],
                 max_queued: int) -> None:
        self.loaded, self.engine, self.detokenize = loaded, engine, detokenize
        self.max_queued = max_queued
        self.pending: deque = deque()
        self.condition = threading.Condition()
        self.active: dict[int, tuple[Job, Choice]] = {}  # slot -> its choice
        self.stopping = False

    # ------------------------------------------------------------------ handler threads
    def submit(self, jobs: list) -> None:
        """Queue ``jobs`` (all or none); QueueFullError when the queue cannot take them."""
        with self.condition:
            if self.stopping:
                raise QueueFullError("the server is stopping")
            if len(self.pending) + len(jobs) > self.max_queued:
                raise QueueFullError(f"the queue of waiting requests is full ({self.max_queued}); retry later")
            self.pending.extend(jobs)
            self.condition.notify()

    def cancel(self, jobs: list) -> None:
        """Stop ``jobs`` (their client left): a waiting one is never admitted, a running one's slots are freed at
        the next step, on every rank (the plan's ``release``)."""
        with self.condition:
            for job in jobs:
                job.cancelled = True
            self.condition.notify()

    def stop(self) -> None:
        with self.condition:
            self.stopping = True
            self.condition.notify()

    # ------------------------------------------------------------------ the engine thread
    def _take(self) -> tuple[list[Job], LegacyJob | None]:
        """Jobs to admit now (as many as free slots allow, in order) or one legacy job; waits while idle."""
        with self.condition:
            while not self.pending and not self.active and not self.stopping:
                self.condition.wait()
            if self.pending and isinstance(self.pending[0], LegacyJob):
                return [], self.pending.popleft()
            free = [s for s in range(self.engine.slots) if s not in self.active or self.active[s][0].cancelled]
            taken = []
            while self.pending and isinstance(self.pending[0], Job):
                job = self.pending[0]
                if job.cancelled:
                    self.pending.popleft()
                    continue
                width = job.sampling.n if job.sampling.max_tokens > 0 else 0
                if width > len(free):
                    break
                self.pending.popleft()
                for choice in job.choices[: width]:
                    choice.slot = free.pop(0)
                taken.append(job)
            return taken, None

    def run(self) -> None:
        """The engine loop of rank 0 until :meth:`stop`; then it tells the other ranks to stop."""
        self.engine.runner.ps.use_device_in_this_thread()  # a new thread starts on GPU 0, not this rank's GPU
        try:
            while self.step() is not None:
                pass
        except BaseException as error:  # a bug here: answer every waiting client before the thread ends
            self.stop()
            in_flight = [job for job, _ in self.active.values()] + list(self.pending)
            for job in in_flight:
                if isinstance(job, Job):
                    job.error = (500, f"the engine stopped: {type(error).__name__}: {error}")
                else:
                    job.outcome = Outcome(500, message=f"the engine stopped: {type(error).__name__}: {error}")
                job.events.put("done")
            raise
        broadcast_request(None, self.engine.device)

    def step(self) -> list[int] | None:
        """One iteration: admit what fits, run one engine step on every rank, record the choices; returns the
        slots that got a token (None once stopping with nothing left; waits while idle)."""
        device = self.engine.device
        jobs, legacy = self._take()
        if self.stopping and not jobs and legacy is None:
            return None
        if legacy is not None:
            broadcast_request({"legacy": legacy.request}, device)
            legacy.outcome = serve_request(self.loaded, legacy.request, device)
            legacy.events.put("done")
            return []
        admissions = [Admission([c.slot for c in job.choices if c.slot is not None], job.ids,
                                job.sampling.logprobs if job.sampling.echo and job.sampling.logprobs is not None
                                else None, job.sampling.max_tokens > 0) for job in jobs]
        with self.condition:  # the handlers cancel under the lock; _take counted these slots as free
            released = sorted(slot for slot, (job, _) in self.active.items() if job.cancelled)
            for slot in released:
                del self.active[slot]
        broadcast_request({"admit": [vars(a) for a in admissions], "release": released}, device)
        for job in jobs:
            for choice in job.choices:
                if choice.slot is not None:
                    self.active[choice.slot] = (job, choice)
        out, error = run_engine_step(self.engine, admissions, released)
        if error is not None:
            self._fail_all(jobs, error)
            return []
        for job, scores in zip(jobs, out.prompt_scores):
            job.prompt_scores = scores
            if job.sampling.max_tokens == 0:  # scored only: done with this step
                for choice in job.choices:
                    choice.finish_reason = "length"
        choices = self._choose(out)
        broadcast_choices(choices, len(out.rows), device)
        self._commit(jobs, out, choices)
        return out.rows

    def _fail_all(self, jobs: list[Job], error: str) -> None:
        status, _, message = error.partition(" ")
        failed = {id(job): job for job in jobs}
        failed.update({id(job): job for job, _ in self.active.values()})
        self.active.clear()
        for job in failed.values():
            job.error = (int(status), message)
            job.events.put("done")

    def _choose(self, out: StepOutput) -> torch.Tensor | None:
        """Long ``[rows, 2]``: each row's token and whether its sequence ends (rank 0 decides for all ranks)."""
        if out.logits is None:
            return None
        rows = [self.active[slot] for slot in out.rows]
        try:
            tokens = self._tokens(out.logits, rows)
            logp = out.logits.log_softmax(dim=-1) if any(job.sampling.logprobs is not None for job, _ in rows) \
                else None
            for row, (job, choice) in enumerate(rows):
                self._record(job, choice, tokens[row], None if logp is None else logp[row])
            ends = [ENDED if choice.finish_reason else 0 for _, choice in rows]
            return torch.tensor(list(zip(tokens, ends)), dtype=torch.long)  # (rows, 2), contiguous: broadcast
        except Exception as error:  # noqa: BLE001 - the other ranks wait for the choices: always send them
            for job, _ in rows:
                job.error = (500, f"choosing tokens failed: {type(error).__name__}: {error}")
            return torch.tensor([[0, FAILED]] * len(rows), dtype=torch.long)

    def _tokens(self, logits: torch.Tensor, rows: list[tuple[Job, Choice]]) -> list[int]:
        """Each row's next token: greedy rows from one argmax; sampled rows processed together per setting
        (``process_logits`` is per row), then drawn together, each with a uniform from its own choice's generator."""
        tokens = logits.max(dim=-1).indices.tolist()  # the first maximum, as argmax
        groups: dict[tuple[float, int, float], list[int]] = {}
        for row, (job, _) in enumerate(rows):
            sampling = job.sampling
            if sampling.temperature != 0:
                groups.setdefault((sampling.temperature, sampling.top_k, sampling.top_p), []).append(row)
        for (temperature, top_k, top_p), group in groups.items():
            cdf = process_logits(logits[group], temperature, top_k, top_p).softmax(dim=-1).cumsum(dim=-1)  # (g, V)
            # Inverse CDF with one uniform per row from its own choice's generator: the draw depends on nothing else
            # in the batch (torch.multinomial per row drew V random numbers each: benchmarks/serving_step.py).
            # Scaled to the row's total mass, the uniform lands on a token of nonzero probability.
            uniforms = torch.cat([torch.rand(1, generator=self._generator(*rows[row], logits), device=logits.device)
                                  for row in group])
            drawn = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True).squeeze(1)
            for row, token in zip(group, drawn.tolist()):
                tokens[row] = token
        return tokens

    @staticmethod
    def _generator(job: Job, choice: Choice, logits: torch.Tensor) -> torch.Generator:
        """The choice's generator, seeded ``seed + i`` for its choice ``i`` on its first draw."""
        if choice.generator is None:
            choice.generator = torch.Generator(device=logits.device)
            seed = job.sampling.seed if job.sampling.seed is not None else secrets.randbits(62)
            choice.generator.manual_seed((seed + choice.index - job.first_index) % 2**63)
        return choice.generator

    def _record(self, job: Job, choice: Choice, token: int, logp: torch.Tensor | None) -> None:
        """Append ``token`` to ``choice`` and decide whether it ended (end of text, length, a stop string).

        Handler threads read the choice meanwhile: log-probabilities come before the token, the text after it,
        the finish reason last (so a reader that sees it sees the final text). ``logp``: the row's log-probabilities
        ``[vocab]`` (None when the request asks for none)."""
        sampling = job.sampling
        if sampling.logprobs is not None:
            best = logp.topk(min(sampling.logprobs, logp.shape[0])) if sampling.logprobs else None
            choice.top_logprobs.append(list(zip(best.indices.tolist(), best.values.tolist())) if best else [])
            choice.token_logprobs.append(float(logp[token]))
        choice.tokens.append(token)
        if choice.decoded is None:
            choice.decoded = IncrementalText(self.detokenize)
        text = choice.decoded.push(token) if token != self.loaded.eod else choice.decoded.text
        stop = first_stop(text, sampling.stop, choice.searched) if sampling.stop else None
        choice.searched = len(choice.decoded.confirmed)
        choice.text = text if stop is None else text[:stop]
        if token == self.loaded.eod or stop is not None:
            choice.finish_reason = "stop"
        elif len(choice.tokens) >= sampling.max_tokens or len(job.ids) + len(choice.tokens) >= self.engine.max_length:
            choice.finish_reason = "length"

    def _commit(self, jobs: list[Job], out: StepOutput, choices: torch.Tensor | None) -> None:
        moves = self.engine.commit(out.rows, choices) if choices is not None else {}
        changed = {id(job): job for job in jobs}
        flags = choices[:, 1].tolist() if choices is not None else []  # one conversion, not a tensor index per row
        for slot, flag in zip(out.rows, flags):
            job, choice = self.active[slot]
            changed[id(job)] = job
            if flag in (ENDED, FAILED):
                del self.active[slot]
        for old, new in moves.items():  # the engine moved these sequences down (BatchEngine.commit)
            job, choice = self.active.pop(old)
            choice.slot = new
            self.active[new] = (job, choice)
        for job in changed.values():
            if job.error is not None or job.done:
                job.events.put("done")
            elif job.streamed:
                job.events.put("update")


def run_engine_step(engine: BatchEngine, admissions: list[Admission], released: list[int]
                    ) -> tuple[StepOutput | None, str | None]:
    """Free the ``released`` slots (their clients left), then ``engine.check`` and ``engine.forward(admissions)`` on
    this rank, failures agreed by all ranks after each: ``(output, None)`` or ``(None, "<status> <message>")``, after
    which every rank's engine is empty."""
    for slot in released:
        engine.release(slot)
    group = comm.world_group()
    _, error = attempt(lambda: engine.check(admissions))
    agreed = comm.first_error(error, group, engine.device)
    if agreed is None:
        out, error = attempt(lambda: engine.forward(admissions))
        agreed = comm.first_error(error, group, engine.device)
    if agreed is not None:
        engine.reset()
        return None, agreed
    return out, None


def run_follower_loop(loaded: InferenceModel, engine: BatchEngine) -> None:
    """Ranks other than 0: follow rank 0's plans (batched steps and legacy requests) until it says stop."""
    device = engine.device
    while (plan := broadcast_request(None, device)) is not None:
        if "legacy" in plan:
            serve_request(loaded, plan["legacy"], device)
            continue
        out, error = run_engine_step(engine, [Admission(**a) for a in plan["admit"]], plan["release"])
        if error is None:
            choices = broadcast_choices(None, len(out.rows), device)
            engine.commit(out.rows, choices)


def wait(job: Job | LegacyJob, timeout: float | None = None) -> str | None:
    """The next event of ``job`` (None after ``timeout`` seconds)."""
    try:
        return job.events.get(timeout=timeout)
    except queue.Empty:
        return None


def now() -> int:
    return int(time.time())
