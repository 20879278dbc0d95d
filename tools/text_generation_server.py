"""HTTP text generation server with Megatron's API, on one process or under torchrun (tp x pp).

    python tools/text_generation_server.py --load ckpt --port 5000
    torchrun --nproc_per_node=2 tools/text_generation_server.py --load ckpt --tensor-model-parallel-size 2
    curl -X PUT http://127.0.0.1:5000/api -H 'Content-Type: application/json' \\
        -d '{"prompts": ["The history of"], "tokens_to_generate": 32, "top_p": 0.9}'

``PUT /api`` takes a JSON object with ``prompts`` (list of strings; for a checkpoint without a tokenizer,
strings of space-separated token ids), ``tokens_to_generate``, and optionally ``temperature``, ``top_k``,
``top_p``, ``beam_width``, ``random_seed``, ``min_tokens_to_generate``, ``add_BOS`` (accepted, unused).
As in Megatron, ``top_k == 1`` is greedy, ``top_p == 0`` and ``top_k == 0`` mean no filtering, and
``beam_width`` selects beam search. The answer: ``text`` (prompt + continuation, per prompt),
``generated_text``, ``tokens`` (generated ids) and, for beam search, ``scores``.

Every field is checked (type, finite, range, prompt length, output length, batch size, body size)
before any work; a bad request gets ``400`` and ``{"message": ...}`` naming the rule. Any temperature in
(0, 100] is accepted and safe (see ``process_logits``). Requests are served one at a time (a lock):
rank 0 listens on ``--host`` (127.0.0.1 by default) and broadcasts each valid request to the other ranks
of the model, which generate with it. A failure while generating, on any rank, is agreed by all ranks
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
import sys
import threading
from dataclasses import dataclass
from http.server import ThreadingHTTPServer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_like.config import ConfigError  # noqa: E402
from megatron_like.inference import cli  # noqa: E402
from megatron_like.inference.generation import GenerationParams  # noqa: E402
from megatron_like.inference.json_http import JsonRequestHandler, LengthError  # noqa: E402
from megatron_like.inference.loading import InferenceModel  # noqa: E402
from megatron_like.inference.serving import broadcast_request, run_follower, serve_request  # noqa: E402

FIELDS = ("prompts", "tokens_to_generate", "temperature", "top_k", "top_p", "beam_width", "random_seed",
          "min_tokens_to_generate", "add_BOS")


class RequestError(ValueError):
    """A request the server refuses with 400; the message goes back to the client."""


@dataclass
class Limits:
    max_prompts: int = 16
    max_prompt_tokens: int = 1024
    max_tokens_to_generate: int = 256
    max_beam_width: int = 16
    max_body_bytes: int = 1 << 20


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
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise RequestError(f"request body is not valid JSON: {error}") from None
    except RecursionError:
        raise RequestError("request body nests JSON arrays or objects too deeply") from None
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
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
# Rank 0: HTTP (every rank runs the request in megatron_like.inference.serving)
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


def make_handler(loaded: InferenceModel, limits: Limits, lock: threading.Lock, request_timeout: float = 60.0):
    class Handler(JsonRequestHandler):
        timeout = request_timeout

        def do_PUT(self) -> None:
            try:
                self.handle_put()
            except TimeoutError:
                raise  # answered 408 by JsonRequestHandler
            except Exception as error:  # noqa: BLE001 - one request must never take the server down
                self.log_message("request failed: %s: %s", type(error).__name__, error)
                self.send_error(500, f"internal error: {type(error).__name__}: {error}")

        def handle_put(self) -> None:
            if self.path.rstrip("/") != "/api":
                return self.send_error(404, f"no endpoint {self.path}; use PUT /api")
            try:
                raw = self.read_body(self.content_length(limits.max_body_bytes))
            except LengthError as error:
                return self.send_error(error.status, str(error))
            try:
                prompts, ids, params = parse_request(raw, loaded, limits)
            except (RequestError, ValueError) as error:
                return self.reply(400, {"message": str(error)})
            request = {"ids": ids, "params": vars(params)}
            ps = loaded.model[0].ps
            with lock:
                ps.use_device_in_this_thread()  # handler threads start on GPU 0, not on this rank's GPU
                outcome = serve_request(loaded, broadcast_request(request, ps.device), ps.device)
            if outcome.status != 200:
                return self.reply(outcome.status, {"message": outcome.message})
            return self.reply(200, answer(loaded, prompts, outcome.results, params.num_beams > 1))

        def refuse_method(self) -> None:  # every method but PUT (JsonRequestHandler dispatches them here)
            self.send_error(405, f"{self.command} is not supported: use PUT /api with a JSON body")

        def log_message(self, fmt: str, *args) -> None:
            sys.stderr.write(f"[server] {self.address_string()} {fmt % args}\n")

    return Handler


def build_parser():
    parser = cli.inference_parser("Serve text generation over HTTP (Megatron's PUT /api)")
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="Address to bind (default: loopback only).")
    g.add_argument("--port", type=int, default=5000)
    g.add_argument("--max-prompts", type=int, default=16, help="Prompts per request at most.")
    g.add_argument("--max-prompt-tokens", type=int, default=1024, help="Tokens per prompt at most.")
    g.add_argument("--max-tokens-to-generate", type=int, default=256, help="tokens_to_generate at most.")
    g.add_argument("--request-timeout", type=float, default=60.0,
                   help="Seconds a client may take to send any part of its request before it gets 408.")
    return parser


def main(argv: list[str] | None = None) -> None:
    args, config = cli.parse(build_parser(), argv)
    if not 0 < args.request_timeout < math.inf:
        cli.fail(f"--request-timeout {args.request_timeout} must be a positive number of seconds")
    try:
        ps = cli.setup(config)
        loaded = cli.load(config, ps, args.iteration)
    except (ConfigError, ValueError, FileNotFoundError, RuntimeError) as error:
        cli.fail(str(error))
    limits = Limits(args.max_prompts, args.max_prompt_tokens, args.max_tokens_to_generate)
    if ps.rank != 0:  # follow rank 0's requests until it stops
        run_follower(loaded, ps.device)
        ps.destroy()
        return
    handler = make_handler(loaded, limits, threading.Lock(), args.request_timeout)
    server = ThreadingHTTPServer((args.host, args.port), handler)
    print(f"serving on http://{args.host}:{server.server_address[1]}/api", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        broadcast_request(None, ps.device)
        ps.destroy()


if __name__ == "__main__":
    main()
