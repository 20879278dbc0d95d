"""OpenAI's completion and chat shapes: a request body -> :class:`~megatron_like.inference.scheduler.Job` s, and the
jobs' state -> an answer (whole, or the server-sent events of a stream).

``POST /v1/completions`` takes ``prompt`` (a string, a list of strings, a list of token ids or a list of such
lists), ``max_tokens`` (default 16; 0 with ``echo`` scores the prompt only), ``temperature`` (0 = greedy),
``top_p``, ``top_k`` (an extension, 0 or -1 = all), ``n``, ``stop`` (a string or a list), ``seed``, ``logprobs``
(alternatives per token, 0-20), ``echo``, ``stream``, ``stream_options.include_usage``; ``model`` and ``user``
are accepted and ignored. ``POST /v1/chat/completions`` takes ``messages`` instead of ``prompt`` (rendered by
:class:`ChatTemplate`), ``max_completion_tokens`` as ``max_tokens``, ``logprobs`` true/false and
``top_logprobs``. Any other field, or an unsupported value (a penalty, ``best_of``, ``logit_bias``), is refused
with a 400 naming it: a client is told what is not done rather than silently getting something else.
"""

from __future__ import annotations

import json
import math
import os
import uuid

from megatron_like.inference.scheduler import Job, Sampling, now

MAX_LOGPROBS = 20
MAX_STOPS = 16
IGNORED = {"model", "user", "stream_options"}
DEFAULT_ONLY = {"presence_penalty": 0, "frequency_penalty": 0, "best_of": None, "logit_bias": None, "suffix": None,
                "parallel_tool_calls": None, "tools": None, "tool_choice": None, "response_format": None}
COMMON = {"max_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed", "stream"}
COMPLETION_FIELDS = COMMON | {"prompt", "logprobs", "echo"}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}

class RequestError(ValueError):
    """A request refused with 400; the message goes back in ``error.message``."""


def error_body(message: str, kind: str = "invalid_request_error") -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise RequestError(message)


def _number(body: dict, name: str, default, kind: type, low: float, high: float):
    value = body.get(name, default)
    if value is None:
        value = default
    allowed = (int, float) if kind is float else int
    _check(not isinstance(value, bool) and isinstance(value, allowed),
           f"{name} must be {'a number' if kind is float else 'an integer'}")
    _check(math.isfinite(value), f"{name} must be a finite number")
    _check(low <= value <= high, f"{name} {value} must be in [{low}, {high}]")
    return kind(value)


def parse_json(raw: bytes) -> dict:
    """The JSON object of a request body; RequestError says what is wrong."""
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise RequestError(f"request body is not valid JSON: {error}") from None
    except RecursionError:
        raise RequestError("request body nests JSON arrays or objects too deeply") from None
    _check(isinstance(body, dict), "request body must be a JSON object")
    return body


def _fields(body: dict, allowed: set[str]) -> None:
    unknown = sorted(set(body) - allowed - IGNORED - set(DEFAULT_ONLY))
    _check(not unknown, f"unsupported field(s) {', '.join(unknown)}; this server takes: {', '.join(sorted(allowed))}")
    for name, default in DEFAULT_ONLY.items():
        value = body.get(name, default)
        _check(value == default or (default is None and value in ({}, [])), f"{name} is not supported (send "
               f"{json.dumps(default)} or leave it out)")
    options = body.get("stream_options")
    _check(options is None or (isinstance(options, dict) and set(options) <= {"include_usage"}
                               and isinstance(options.get("include_usage", False), bool)),
           "stream_options must be {\"include_usage\": true|false}")


def _sampling(body: dict, limits, max_tokens: int, logprobs: int | None, echo: bool) -> Sampling:
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    _check(isinstance(stop, list) and all(isinstance(s, str) and s for s in stop) and len(stop) <= MAX_STOPS,
           f"stop must be a non-empty string or a list of at most {MAX_STOPS} of them")
    top_k = _number(body, "top_k", 0, int, -1, 2**31)
    seed = body.get("seed")
    _check(seed is None or (isinstance(seed, int) and not isinstance(seed, bool) and -2**63 <= seed < 2**64),
           "seed must be an integer")
    return Sampling(max_tokens=max_tokens, temperature=_number(body, "temperature", 1.0, float, 0.0, 100.0),
                    top_p=_number(body, "top_p", 1.0, float, 1e-9, 1.0), top_k=max(top_k, 0),
                    n=_number(body, "n", 1, int, 1, limits.max_batch_size), stop=stop, seed=seed,
                    logprobs=logprobs, echo=echo)


def _token_ids(value) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _prompt_ids(prompt, encode, limits, vocab_size: int) -> list[list[int]]:
    """Token ids of each prompt of ``prompt`` (OpenAI's four forms)."""
    one = isinstance(prompt, str) or (_token_ids(prompt) and len(prompt) > 0)
    prompts = [prompt] if one else prompt
    _check(isinstance(prompts, list) and prompts and all(isinstance(p, str) or _token_ids(p) for p in prompts),
           "prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids")
    _check(len(prompts) <= limits.max_prompts, f"{len(prompts)} prompts exceed the limit of {limits.max_prompts}")
    ids = []
    for i, p in enumerate(prompts):
        tokens = encode(p) if isinstance(p, str) else p
        _check(len(tokens) > 0, f"prompt {i} is empty")
        _check(all(0 <= t < vocab_size for t in tokens), f"prompt {i}: token ids must be in [0, {vocab_size})")
        _check(len(tokens) <= limits.max_prompt_tokens,
               f"prompt {i} has {len(tokens)} tokens, more than the limit of {limits.max_prompt_tokens}")
        ids.append(tokens)
    return ids


def _max_tokens(body: dict, name: str, limits, positions: int, ids: list[list[int]], default: int | None,
                allow_zero: bool) -> int:
    room = positions - max(map(len, ids))
    _check(room > (0 if not allow_zero else -1), f"the prompt ({max(map(len, ids))} tokens) leaves no room in the "
           f"model's {positions} positions")
    if body.get(name) is None:
        return min(limits.max_tokens_to_generate, room) if default is None else min(default, room)
    value = _number(body, name, None, int, 0 if allow_zero else 1, limits.max_tokens_to_generate)
    _check(value <= room, f"prompt ({max(map(len, ids))} tokens) + {name} {value} exceeds the model's {positions} "
           "positions")
    return value


def parse_completion(raw: bytes, server) -> tuple[list[Job], bool, dict]:
    """(jobs, stream, body) of a ``/v1/completions`` request; RequestError says what is wrong."""
    body = parse_json(raw)
    _fields(body, COMPLETION_FIELDS)
    _check("prompt" in body, "prompt is required")
    ids = _prompt_ids(body["prompt"], server.encode, server.limits, server.loaded.vocab_size)
    echo = body.get("echo", False)
    _check(isinstance(echo, bool), "echo must be true or false")
    logprobs = None if body.get("logprobs") is None else _number(body, "logprobs", 0, int, 0, MAX_LOGPROBS)
    max_tokens = _max_tokens(body, "max_tokens", server.limits, server.positions, ids, 16, allow_zero=echo)
    sampling = _sampling(body, server.limits, max_tokens, logprobs, echo)
    stream = body.get("stream", False)
    _check(isinstance(stream, bool), "stream must be true or false")
    _check(not (stream and max_tokens == 0), "stream needs max_tokens >= 1")
    return [Job(p, sampling, i * sampling.n) for i, p in enumerate(ids)], stream, body


def _message_text(message, i: int) -> tuple[str, str]:
    _check(isinstance(message, dict) and isinstance(message.get("role"), str), f"messages[{i}] must be an object "
           "with a role")
    content = message.get("content")
    if isinstance(content, list):  # content parts: only text ones
        _check(all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content),
               f"messages[{i}].content parts must be text parts")
        content = "".join(p["text"] for p in content)
    _check(isinstance(content, str), f"messages[{i}].content must be a string")
    return message["role"], content


def parse_chat(raw: bytes, server) -> tuple[list[Job], bool, dict]:
    """(jobs, stream, body) of a ``/v1/chat/completions`` request; RequestError says what is wrong."""
    body = parse_json(raw)
    _fields(body, CHAT_FIELDS)
    messages = body.get("messages")
    _check(isinstance(messages, list) and messages, "messages must be a non-empty list")
    messages = [dict(zip(("role", "content"), _message_text(m, i))) for i, m in enumerate(messages)]
    prompt = server.chat_template.render(messages)
    ids = _prompt_ids(prompt, server.encode, server.limits, server.loaded.vocab_size)
    want = body.get("logprobs", False)
    _check(isinstance(want, bool), "logprobs must be true or false")
    top = _number(body, "top_logprobs", 0, int, 0, MAX_LOGPROBS)
    _check(want or "top_logprobs" not in body or body["top_logprobs"] is None, "top_logprobs needs logprobs: true")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _max_tokens(body, name, server.limits, server.positions, ids, None, allow_zero=False)
    sampling = _sampling(body, server.limits, max_tokens, top if want else None, False)
    stream = body.get("stream", False)
    _check(isinstance(stream, bool), "stream must be true or false")
    return [Job(ids[0], sampling)], stream, body


class ChatTemplate:
    """Renders chat messages to a prompt: the checkpoint's ``chat_template`` (from a ``tokenizer_config.json``)
    with jinja2 in a sandbox, as Hugging Face does; without one, a plain default: one ``role: content`` line per
    message, then ``assistant:``."""

    def __init__(self, source: str | None = None, bos_token: str = "", eos_token: str = "") -> None:
        self.source = source
        self.bos_token, self.eos_token = bos_token, eos_token
        self._template = None
        if source is not None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment  # only a checkpoint with a template needs it

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            self._template = env.from_string(source)

    @classmethod
    def find(cls, directories: list[str | None]) -> ChatTemplate:
        """The template of the first ``tokenizer_config.json`` with one in ``directories``, else the default."""
        for directory in directories:
            path = os.path.join(directory, "tokenizer_config.json") if directory else ""
            if directory and os.path.isfile(path):
                with open(path) as f:
                    config = json.load(f)
                if isinstance(config.get("chat_template"), str):
                    bos, eos = (config.get(name) for name in ("bos_token", "eos_token"))
                    return cls(config["chat_template"], bos if isinstance(bos, str) else "",
                               eos if isinstance(eos, str) else "")
        return cls()

    def render(self, messages: list[dict]) -> str:
        if self._template is None:
            lines = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
            return lines + "assistant:"
        try:
            return self._template.render(messages=messages, add_generation_prompt=True, bos_token=self.bos_token,
                                         eos_token=self.eos_token)
        except Exception as error:  # noqa: BLE001 - a template's own raise_exception, or a type error in it
            raise RequestError(f"the chat template refused the messages: {error}") from None


# --------------------------------------------------------------------------------------------------
# Answers
# --------------------------------------------------------------------------------------------------


def usage(jobs: list[Job]) -> dict:
    prompt = sum(len(job.ids) for job in jobs)
    completion = sum(len(c.tokens) for job in jobs for c in job.choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_logprobs(job: Job, choice_index: int, token_text, start: int = 0) -> dict:
    """OpenAI's legacy ``logprobs`` object of one choice: its generated tokens from ``start`` on, preceded by the
    prompt's when echoing (the first prompt token has no log-probability)."""
    choice = job.choices[choice_index]
    tokens, logprobs, tops = [], [], []
    if job.sampling.echo and start == 0:
        tokens.append(job.ids[0])
        logprobs.append(None)
        tops.append(None)
        scores, k = job.prompt_scores, job.sampling.logprobs
        for i, token in enumerate(job.ids[1:]):
            tokens.append(token)
            logprobs.append(float(scores[i, 0]))
            tops.append({token_text(int(t)): float(v) for v, t in zip(scores[i, 1:1 + k], scores[i, 1 + k:])})
    for token, logprob, top in zip(choice.tokens[start:], choice.token_logprobs[start:], choice.top_logprobs[start:]):
        tokens.append(token)
        logprobs.append(logprob)
        tops.append({token_text(t): v for t, v in top})
    texts = [token_text(t) for t in tokens]
    offsets, at = [], 0
    for text in texts:
        offsets.append(at)
        at += len(text)
    return {"tokens": texts, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(choice, token_text, start: int = 0) -> dict:
    """OpenAI's chat ``logprobs`` object of ``choice``'s tokens from ``start`` on."""
    def entry(token: int, logprob: float) -> dict:
        text = token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, v) for a, v in top]}
                        for t, lp, top in zip(choice.tokens[start:], choice.token_logprobs[start:],
                                              choice.top_logprobs[start:])]}


def completion_answer(jobs: list[Job], model: str, token_text, prompt_text) -> dict:
    choices = []
    for job in jobs:
        for i, choice in enumerate(job.choices):
            text = (prompt_text(job.ids) if job.sampling.echo else "") + choice.text
            logprobs = completion_logprobs(job, i, token_text) if job.sampling.logprobs is not None else None
            choices.append({"index": choice.index, "text": text, "logprobs": logprobs,
                            "finish_reason": choice.finish_reason})
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": now(), "model": model,
            "choices": choices, "usage": usage(jobs)}


def chat_answer(jobs: list[Job], model: str, token_text) -> dict:
    job = jobs[0]
    choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": chat_logprobs(c, token_text) if job.sampling.logprobs is not None else None,
                "finish_reason": c.finish_reason} for c in job.choices]
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": now(), "model": model,
            "choices": choices, "usage": usage(jobs)}
