"""HTTP text generation server: OpenAI's /v1 API with continuous batching, and Megatron's PUT /api; one process or
torchrun (any tp x pp x ep layout).

    python tools/text_generation_server.py --load ckpt --port 5000
    torchrun --nproc_per_node=2 tools/text_generation_server.py --load ckpt --tensor-model-parallel-size 2
    curl http://127.0.0.1:5000/v1/completions -H 'Content-Type: application/json' \
        -d '{"prompt": "The history of", "max_tokens": 32, "top_p": 0.9}'
    curl -X PUT http://127.0.0.1:5000/api -H 'Content-Type: application/json' \
        -d '{"prompts": ["The history of"], "tokens_to_generate": 32, "top_p": 0.9}'

``POST /v1/completions``, ``POST /v1/chat/completions`` (``megatron_like/inference/openai_api.py``: fields,
answers, errors as ``{"error": {"message": ...}}``, streaming as server-sent events), ``GET /v1/models``,
``GET /health`` and vLLM's ``/tokenizer_info``, ``/tokenize``, ``/detokenize`` (what lm-evaluation-harness
uses). Requests to /v1 are batched continuously: one engine thread on rank 0
(``megatron_like/inference/scheduler.py``) admits queued requests into free slots at every decoding step and
every rank runs the step (``megatron_like/inference/batching.py``); ``--max-batch-size`` sequences at once,
``--max-queued-requests`` waiting (then ``503``). A /v1 client that closes its connection before the end of its
answer stops its request: its slots are freed at the next step.

``PUT /api`` takes a JSON object with ``prompts`` (list of strings; for a checkpoint without a tokenizer,
strings of space-separated token ids), ``tokens_to_generate``, and optionally ``temperature``, ``top_k``,
``top_p``, ``beam_width``, ``random_seed``, ``min_tokens_to_generate``, ``add_BOS`` (accepted, unused).
As in Megatron, ``top_k == 1`` is greedy, ``top_p == 0`` and ``top_k == 0`` mean no filtering, and
``beam_width`` selects beam search. The answer: ``text`` (prompt + continuation, per prompt),
``generated_text``, ``tokens`` (generated ids) and, for beam search, ``scores``. These requests go through
the same queue and are served whole, one at a time, between two batched steps.

Every field is checked (type, finite, range, prompt length, output length, batch size, body size)
before any work; a bad request gets ``400`` naming the rule. Any temperature in (0, 100] is accepted and
safe (see ``process_logits``). Rank 0 listens on ``--host`` (127.0.0.1 by default) and broadcasts each
plan to the other ranks of the model. A failure while generating, on any rank, is agreed by all ranks
before rank 0 answers (``megatron_like/inference/serving.py``): ``400`` for a request the model cannot
serve, ``500`` for anything else, and every rank goes on serving. Every answer has a status line and a
JSON body (``megatron_like/inference/json_http.py``), also for other methods (``405``), unknown paths
(``404``), malformed HTTP (``400``: request lines, bare-CR line ends, Content-Length, a body shorter than
its Content-Length), chunked bodies (``411``) and a request that stops coming (``408`` after
``--request-timeout`` seconds, 60 by default).
"""

from __future__ import annotations

import json
import math
import os
import select
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from http.server import ThreadingHTTPServer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_like.config import ConfigError  # noqa: E402
from megatron_like.inference import cli  # noqa: E402
from megatron_like.inference.batching import BatchEngine  # noqa: E402
from megatron_like.inference.generation import GenerationParams  # noqa: E402
from megatron_like.inference.json_http import JsonRequestHandler, LengthError  # noqa: E402
from megatron_like.inference.loading import InferenceModel  # noqa: E402
from megatron_like.inference.openai_api import (  # noqa: E402
    ChatTemplate,
    RequestError,
    chat_answer,
    chat_logprobs,
    completion_answer,
    completion_logprobs,
    error_body,
    parse_chat,
    parse_completion,
    parse_json,
    usage,
)
from megatron_like.inference.scheduler import LegacyJob, QueueFullError, Scheduler, now, run_follower_loop, wait  # noqa: E402

FIELDS = ("prompts", "tokens_to_generate", "temperature", "top_k", "top_p", "beam_width", "random_seed",
          "min_tokens_to_generate", "add_BOS")


@dataclass
class Limits:
    max_prompts: int = 16
    max_prompt_tokens: int = 1024
    max_tokens_to_generate: int = 256
    max_beam_width: int = 16
    max_body_bytes: int = 1 << 20
    max_batch_size: int = 16


def _number(body: dict, name: str, default, kind: type, low: float, high: float, low_open: bool = False):
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        # A list or object is named, not shown: its repr could recurse as deep as the JSON nests.
        shown = f"a JSON {'array' if isinstance(value, list) else 'object'}" if isinstance(value, (list, dict)) \
            else f"{value!r:.80}"
        raise RequestError(f"{name} must be {'a number' if kind is float else 'an integer'}, got {shown}")
    if not math.isfinite(value):  # json.loads accepts NaN and Infinity
        raise RequestError(f"{name} must be a finite number, got {value}")
    if value < low or value > high or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise RequestError(f"{name} {value} must be in {bracket}{low}, {high}]")
    return kind(value)


def parse_request(raw: bytes, loaded: InferenceModel, limits: Limits) -> tuple[list[str], list[list[int]],
                                                                                 GenerationParams]:
    """(prompt texts, prompt ids, params) of a request body; RequestError says what is wrong."""
    if len(raw) > limits.max_body_bytes:
        raise RequestError(f"request body of {len(raw)} bytes exceeds the limit of {limits.max_body_bytes}")
    body = parse_json(raw)
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise RequestError(f"unknown field(s) {', '.join(unknown)}; allowed: {', '.join(FIELDS)}")
    prompts = body.get("prompts")
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise RequestError("prompts must be a non-empty list of strings")
    if len(prompts) > limits.max_prompts:
        raise RequestError(f"{len(prompts)} prompts exceed the batch limit of {limits.max_prompts}")
    if "tokens_to_generate" not in body:
        raise RequestError("tokens_to_generate is required")
    new_tokens = _number(body, "tokens_to_generate", None, int, 1, limits.max_tokens_to_generate)
    min_tokens = _number(body, "min_tokens_to_generate", 0, int, 0, new_tokens)
    temperature = _number(body, "temperature", 1.0, float, 0.0, 100.0, low_open=True)
    top_k = _number(body, "top_k", 0, int, 0, loaded.vocab_size)
    top_p = _number(body, "top_p", 0.0, float, 0.0, 1.0)
    beam_width = _number(body, "beam_width", 1, int, 1, limits.max_beam_width)
    seed = _number(body, "random_seed", 1234, int, 0, 2**63 - 1)
    if not isinstance(body.get("add_BOS", False), bool):
        raise RequestError("add_BOS must be true or false")
    ids = []
    for i, text in enumerate(prompts):
        if loaded.tokenizer is not None:
            tokens = loaded.tokenizer.tokenize(text)
        else:
            try:
                tokens = [int(t) for t in text.split()]
            except ValueError:
                raise RequestError(f"prompts[{i}]: this model has no tokenizer; send space-separated "
                                   "token ids") from None
            if any(not 0 <= t < loaded.vocab_size for t in tokens):
                raise RequestError(f"prompts[{i}]: token ids must be in [0, {loaded.vocab_size})")
        if not tokens:
            raise RequestError(f"prompts[{i}] is empty")
        if len(tokens) > limits.max_prompt_tokens:
            raise RequestError(f"prompts[{i}] has {len(tokens)} tokens, more than the limit of "
                               f"{limits.max_prompt_tokens}")
        ids.append(tokens)
    positions = loaded.config.model.max_positions
    if max(map(len, ids)) + new_tokens > positions:
        raise RequestError(f"longest prompt ({max(map(len, ids))} tokens) + tokens_to_generate {new_tokens} "
                           f"exceeds the model's {positions} positions")
    params = GenerationParams(max_new_tokens=new_tokens, min_new_tokens=min_tokens, seed=seed)
    if beam_width > 1:
        params.num_beams = beam_width
    elif top_k != 1:
        params.do_sample, params.temperature = True, temperature
        params.top_k, params.top_p = top_k, (top_p if top_p > 0 else 1.0)
    return prompts, ids, params.validate()


# --------------------------------------------------------------------------------------------------
# Rank 0: HTTP (every rank runs the model in megatron_like.inference.batching / serving)
# --------------------------------------------------------------------------------------------------


def answer(loaded: InferenceModel, prompts: list[str], results: list, beam: bool) -> dict:
    tokenizer = loaded.tokenizer
    generated, tokens, scores = [], [], []
    for sequences in results:
        best = sequences[0]
        shown = [t for t in best.token_ids if t != loaded.eod]
        generated.append(tokenizer.detokenize(shown) if tokenizer else " ".join(map(str, shown)))
        tokens.append(best.token_ids)
        scores.append(best.score)
    joiner = "" if tokenizer else " "
    out = {"text": [p + joiner + g for p, g in zip(prompts, generated)], "generated_text": generated, "tokens": tokens}
    if beam:
        out["scores"] = scores
    return out


class Server:
    """What the handlers share on rank 0: the model, its tokenizer functions, the limits, the scheduler."""

    def __init__(self, loaded: InferenceModel, limits: Limits, scheduler: Scheduler | None, model_name: str,
                 chat_template: ChatTemplate) -> None:
        self.loaded, self.limits, self.scheduler = loaded, limits, scheduler
        self.model_name, self.chat_template = model_name, chat_template
        self.positions = loaded.config.model.max_positions
        self.engine_thread: threading.Thread | None = None

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``: the tokenizer's, or space-separated ids for a model without one."""
        if self.loaded.tokenizer is not None:
            return self.loaded.tokenizer.tokenize(text)
        try:
            return [int(t) for t in text.split()]
        except ValueError:
            raise RequestError("this model has no tokenizer; send token ids (or text of space-separated ids)") from None

    def decode(self, ids: list[int]) -> str:
        if self.loaded.tokenizer is not None:
            return self.loaded.tokenizer.detokenize(ids)
        return "".join(f" {t}" for t in ids)  # a continuation of space-separated ids

    def prompt_text(self, ids: list[int]) -> str:
        return self.loaded.tokenizer.detokenize(ids) if self.loaded.tokenizer is not None else " ".join(map(str, ids))

    def token_text(self, token: int) -> str:
        return self.loaded.tokenizer.detokenize([token]) if self.loaded.tokenizer is not None else str(token)

    def tokenizer_info(self) -> dict:
        eos = self.token_text(self.loaded.eod) if self.loaded.eod is not None else None
        return {"eos_token": eos, "bos_token": None, "pad_token": None, "model_max_length": self.positions,
                "chat_template": self.chat_template.source}


def make_handler(server: Server, request_timeout: float = 60.0):
    limits, loaded = server.limits, server.loaded

    class Handler(JsonRequestHandler):
        timeout = request_timeout

        def error_body(self, message: str) -> dict:
            return error_body(message) if getattr(self, "path", "").startswith("/v1") else {"message": message}

        def refuse(self, status: int, message: str) -> None:
            self.reply(status, self.error_body(message))

        def guarded(self, work) -> None:
            try:
                work()
            except TimeoutError:
                raise  # answered 408 by JsonRequestHandler
            except Exception as error:  # noqa: BLE001 - one request must never take the server down
                self.log_message("request failed: %s: %s", type(error).__name__, error)
                self.send_error(500, f"internal error: {type(error).__name__}: {error}")

        def body(self) -> bytes | None:
            try:
                return self.read_body(self.content_length(limits.max_body_bytes))
            except LengthError as error:
                self.send_error(error.status, str(error))
                return None

        def do_GET(self) -> None:
            path = self.path.rstrip("/")
            if path == "/health":  # the engine thread ends only on a bug; then nothing is served
                alive = server.engine_thread is None or server.engine_thread.is_alive()
                return self.reply(200 if alive else 503, {"status": "ok" if alive else "the engine stopped"})
            if path == "/v1/models":
                return self.reply(200, {"object": "list", "data": [{
                    "id": server.model_name, "object": "model", "created": now(), "owned_by": "megatron_like",
                    "max_model_len": server.positions}]})
            if path == "/tokenizer_info":
                return self.reply(200, server.tokenizer_info())
            self.refuse_method()

        def do_POST(self) -> None:
            self.guarded(self.handle_post)

        def do_PUT(self) -> None:
            self.guarded(self.handle_put)

        def handle_post(self) -> None:
            path = self.path.rstrip("/")
            routes = {"/v1/completions": parse_completion, "/v1/chat/completions": parse_chat,
                      "/tokenize": None, "/detokenize": None}
            if path not in routes:
                return self.refuse_method() if path in ("/api", "/health", "/v1/models") else \
                    self.send_error(404, f"no endpoint {self.path}")
            raw = self.body()
            if raw is None:
                return None
            try:
                if path in ("/tokenize", "/detokenize"):
                    return self.tokenizer_endpoint(path, raw)
                jobs, stream, body = routes[path](raw, server)
            except RequestError as error:
                return self.refuse(400, str(error))
            for job in jobs:
                job.streamed = stream
            try:
                server.scheduler.submit(jobs)
            except QueueFullError as error:
                return self.refuse(503, str(error))
            chat = path == "/v1/chat/completions"
            if stream:
                return self.stream(jobs, chat, body)
            for job in jobs:
                while wait(job, timeout=0.1) != "done":  # wakes every 0.1 s to see whether the client left
                    if self.client_gone():
                        return self.abandon(jobs)
            failed = [job.error for job in jobs if job.error is not None]
            if failed:
                return self.refuse(*failed[0])
            if chat:
                return self.reply(200, chat_answer(jobs, server.model_name, server.token_text))
            return self.reply(200, completion_answer(jobs, server.model_name, server.token_text, server.prompt_text))

        def client_gone(self) -> bool:
            """Whether the client closed the connection (or shut down its sending side): a readable socket with
            nothing left to read."""
            try:
                readable, _, _ = select.select([self.connection], [], [], 0)
                return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
            except OSError:
                return True

        def abandon(self, jobs: list) -> None:
            """The client left before its answer: stop its sequences (their slots are freed at the next step)."""
            server.scheduler.cancel(jobs)
            self.close_connection = True

        def tokenizer_endpoint(self, path: str, raw: bytes) -> None:
            body = parse_json(raw)
            if path == "/tokenize":
                if not isinstance(body.get("prompt"), str):
                    raise RequestError("prompt must be a string")
                tokens = server.encode(body["prompt"])
                return self.reply(200, {"tokens": tokens, "count": len(tokens), "max_model_len": server.positions})
            tokens = body.get("tokens")
            if not (isinstance(tokens, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                                     and 0 <= t < loaded.vocab_size for t in tokens)):
                raise RequestError(f"tokens must be a list of token ids in [0, {loaded.vocab_size})")
            return self.reply(200, {"prompt": server.prompt_text(tokens)})

        def stream(self, jobs: list, chat: bool, body: dict) -> None:
            """Server-sent events (chunked): one event per step that produced text, then ``data: [DONE]``."""
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            # Every chunk of one completion has the same id, object, created and model (as OpenAI's): serialized once.
            head = json.dumps({"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                               "object": "chat.completion.chunk" if chat else "text_completion", "created": now(),
                               "model": server.model_name})[:-1].encode()

            def send(data: bytes) -> None:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()

            def event(choices: list, **extra) -> None:
                send(b"data: " + head + b", " + json.dumps({"choices": choices, **extra})[1:].encode() + b"\n\n")

            try:
                if chat:  # OpenAI's first chunk gives the role
                    event([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None} for c in jobs[0].choices])
                pending = list(jobs)
                checked = time.monotonic()
                while pending:
                    state = wait(pending[0], timeout=0.05)
                    # Before a write to a closed socket would tell (if it ever comes); at most every 0.05 s, not at
                    # every step: a check is a system call, and each one hands the GIL back and forth.
                    if state is None or time.monotonic() - checked >= 0.05:
                        if self.client_gone():
                            return self.abandon(jobs)
                        checked = time.monotonic()
                    for job in jobs:
                        pieces = [p for p in (stream_piece(server, job, c, chat) for c in job.choices) if p]
                        if pieces:
                            event(pieces)
                    if state == "done":
                        pending.pop(0)
                failed = [job.error for job in jobs if job.error is not None]
                if failed:
                    send(b"data: " + json.dumps(error_body(failed[0][1])).encode() + b"\n\n")
                elif (body.get("stream_options") or {}).get("include_usage"):
                    event([], usage=usage(jobs))
                send(b"data: [DONE]\n\n")
                send(b"")
            except OSError:  # the client left mid-stream
                self.abandon(jobs)

        def handle_put(self) -> None:
            if self.path.rstrip("/") != "/api":
                return self.refuse_method() if self.path.startswith("/v1") else \
                    self.send_error(404, f"no endpoint {self.path}; use PUT /api")
            raw = self.body()
            if raw is None:
                return None
            try:
                prompts, ids, params = parse_request(raw, loaded, limits)
            except (RequestError, ValueError) as error:
                return self.reply(400, {"message": str(error)})
            job = LegacyJob({"ids": ids, "params": vars(params)})
            try:
                server.scheduler.submit([job])
            except QueueFullError as error:
                return self.reply(503, {"message": str(error)})
            wait(job)
            outcome = job.outcome
            if outcome.status != 200:
                return self.reply(outcome.status, {"message": outcome.message})
            return self.reply(200, answer(loaded, prompts, outcome.results, params.num_beams > 1))

        def refuse_method(self) -> None:  # JsonRequestHandler dispatches every other method here
            self.send_error(405, f"{self.command} is not supported on {self.path}: use PUT /api, POST /v1/completions, "
                                 "POST /v1/chat/completions, GET /v1/models or GET /health")

        def log_message(self, fmt: str, *args) -> None:
            sys.stderr.write(f"[server] {self.address_string()} {fmt % args}\n")

    return Handler


def stream_piece(server: Server, job, choice, chat: bool) -> dict | None:
    """The new part of ``choice`` since its last event, or None when nothing is new.

    Text that may still become a stop string, or an incomplete character, is held back until it is decided.
    """
    if choice.closed:
        return None
    finished = choice.finish_reason is not None  # set last by the engine thread: the text is final then
    tokens_from, text = choice.sent_tokens, choice.text
    end = len(text)
    if not finished:
        end -= max((len(s) - 1 for s in job.sampling.stop), default=0)
        while end > choice.sent and text[end - 1] == "\ufffd":
            end -= 1
    end = max(end, choice.sent)
    delta = text[choice.sent:end]
    if not chat and job.sampling.echo and tokens_from == 0 and choice.sent == 0:
        delta = server.prompt_text(job.ids) + delta
    if not delta and not finished and len(choice.tokens) == tokens_from:
        return None
    choice.sent, choice.sent_tokens, choice.closed = end, len(choice.tokens), finished
    logprobs = None
    if job.sampling.logprobs is not None:
        logprobs = chat_logprobs(choice, server.token_text, tokens_from) if chat else \
            completion_logprobs(job, choice.index - job.first_index, server.token_text, tokens_from)
    reason = choice.finish_reason if finished else None
    if chat:
        return {"index": choice.index, "delta": {"content": delta} if delta else {}, "logprobs": logprobs,
                "finish_reason": reason}
    return {"index": choice.index, "text": delta, "logprobs": logprobs, "finish_reason": reason}


class HttpServer(ThreadingHTTPServer):
    """One thread per connection, with a listen backlog deep enough for a burst of clients: socketserver's default
    of 5 leaves the sixth simultaneous connection unanswered until the client's TCP retry, a second later."""

    request_queue_size = 1024
    daemon_threads = True


def build_parser():
    parser = cli.inference_parser("Serve text generation over HTTP (OpenAI's /v1 API and Megatron's PUT /api)")
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="Address to bind (default: loopback only).")
    g.add_argument("--port", type=int, default=5000)
    g.add_argument("--max-prompts", type=int, default=16, help="Prompts per request at most.")
    g.add_argument("--max-prompt-tokens", type=int, default=1024, help="Tokens per prompt at most.")
    g.add_argument("--max-tokens-to-generate", type=int, default=256,
                   help="tokens_to_generate (PUT /api) and max_tokens (/v1) at most.")
    g.add_argument("--max-batch-size", type=int, default=16,
                   help="Sequences decoded together (continuous batching slots; each holds a KV cache of the "
                        "model's positions).")
    g.add_argument("--max-queued-requests", type=int, default=64,
                   help="Prompts waiting for a slot at most; more are refused with 503.")
    g.add_argument("--served-model-name", default=None, help="The model id of /v1/models (default: --load's name).")
    g.add_argument("--request-timeout", type=float, default=60.0,
                   help="Seconds a client may take to send any part of its request before it gets 408.")
    return parser


def main(argv: list[str] | None = None) -> None:
    args, config = cli.parse(build_parser(), argv)
    if not 0 < args.request_timeout < math.inf:
        cli.fail(f"--request-timeout {args.request_timeout} must be a positive number of seconds")
    for flag in ("max_batch_size", "max_queued_requests", "max_prompts"):
        if getattr(args, flag) < 1:
            cli.fail(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be >= 1")
    try:
        ps = cli.setup(config)
        loaded = cli.load(config, ps, args.iteration)
        engine = BatchEngine(loaded, args.max_batch_size)
    except (ConfigError, ValueError, FileNotFoundError, RuntimeError) as error:
        cli.fail(str(error))
    if ps.rank != 0:  # follow rank 0's plans until it stops
        run_follower_loop(loaded, engine)
        ps.destroy()
        return
    limits = Limits(args.max_prompts, args.max_prompt_tokens, args.max_tokens_to_generate,
                    max_batch_size=args.max_batch_size)
    load_dir, data = config.checkpoint.load, loaded.config.data
    tokenizer_dir = os.path.dirname(data.tokenizer_model or data.vocab_file or "") or None
    if data.tokenizer_model and os.path.isdir(data.tokenizer_model):
        tokenizer_dir = data.tokenizer_model
    server = Server(loaded, limits, None, args.served_model_name or os.path.basename(os.path.normpath(load_dir)),
                    ChatTemplate.find([load_dir, tokenizer_dir]))
    server.scheduler = Scheduler(loaded, engine, server.decode, args.max_queued_requests)
    engine_thread = server.engine_thread = threading.Thread(target=server.scheduler.run, name="engine", daemon=True)
    engine_thread.start()
    http = HttpServer((args.host, args.port), make_handler(server, args.request_timeout))
    print(f"serving on http://{args.host}:{http.server_address[1]} (PUT /api, /v1/completions, "
          "/v1/chat/completions)", flush=True)
    try:
        http.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        http.server_close()
        server.scheduler.stop()
        engine_thread.join()
        ps.destroy()


if __name__ == "__main__":
    main()
