"""Hostile input to the HTTP server on 2 ranks (tp=2, as torchrun starts them): a few hundred random and
malformed requests (to 127.0.0.1 only, bounded sizes), every one answered with JSON, then a normal request must
still give the single-process greedy tokens: no request took a rank down or left the ranks out of step.
Malformed HTTP itself (request lines, line ends, lengths, requests that stop coming) is sent as raw bytes: each
gets a status line and a JSON body, a 4xx, before the server's --request-timeout or at it (408)."""

from __future__ import annotations

import http.client
import json
import random
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from megatron_like.config import parse_config
from megatron_like.inference import GenerationParams, generate, load_inference_model
from megatron_like.model import GPTModel
from megatron_like.parallel_state import ParallelState
from megatron_like.training.checkpointing import save_checkpoint
from tests.distributed.harness import free_port
from tests.e2e.cli import Launched, serve

VOCAB = 64
REQUEST_TIMEOUT = 3  # seconds: the 408 cases wait this long
FLAGS = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
         "--mock-data", "--vocab-size", str(VOCAB), "--make-vocab-size-divisible-by", "8", "--init-method-std", "0.3",
         "--ckpt-format", "torch"]


def tiny_checkpoint(root: str, layers: int = 1, flags: list[str] | None = None) -> str:
    """A model of ``layers`` layers (and ``flags``) saved at iteration 0 in one process (no training needed)."""
    config = parse_config(FLAGS + ["--num-layers", str(layers), *(flags or []), "--save", root], world_size=1)
    ps = ParallelState.single_process(torch.device("cpu"))
    model = GPTModel(config.model, ps, vocab_size=config.padded_vocab_size(VOCAB), seed=3)
    save_checkpoint(root, 0, config, ps, [model], None, None, 0)
    return root


def start_server(checkpoint: str, port: int) -> Launched:
    return serve(2, checkpoint, port, ["--tensor-model-parallel-size", "2", "--max-prompts", "3", "--max-prompt-tokens",
                                       "8", "--max-tokens-to-generate", "4", "--request-timeout", str(REQUEST_TIMEOUT)])


def send(port: int, method: str, path: str, body: bytes | None, headers: dict | None = None) -> tuple[int, dict]:
    """One request on a fresh connection; the answer must be JSON with a message unless it is a 200."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        data = response.read()
    finally:
        connection.close()
    assert response.getheader("Content-Type") == "application/json", (method, path, body, data[:200])
    reply = json.loads(data) if data else {}
    # /v1 answers a refusal in OpenAI's shape, {"error": {"message": ...}}; the others {"message": ...}.
    message = (reply.get("error") or {}).get("message") if path.startswith("/v1") else reply.get("message")
    assert response.status == 200 or message, (method, path, body, response.status, reply)
    return response.status, reply


def random_value(rng: random.Random, depth: int = 0):
    kinds = ["int", "float", "str", "bool", "none", "list", "dict", "special"]
    kind = rng.choice(kinds if depth < 2 else kinds[:5])
    if kind == "int":
        return rng.choice([0, 1, -1, 2, 3, 63, 64, 65, 2**31, 2**63, -(2**63), 10**30, rng.randint(-100, 100)])
    if kind == "float":
        return rng.choice([0.0, 1e-300, 5e-324, -0.5, 0.5, 1.0, 1.5, 99.9, 100.0, 1e300, rng.uniform(-2, 2)])
    if kind == "str":
        return rng.choice(["", "1 2 3", "63", "64", "-1", "a b", "1" * 200, "\u2603", "3 " * 9, " "])
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "none":
        return None
    if kind == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if kind == "dict":
        return {rng.choice(["a", "prompts", "x"]): random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}
    return rng.choice([float("nan"), float("inf"), float("-inf")])


FIELDS = ["prompts", "tokens_to_generate", "temperature", "top_k", "top_p", "beam_width", "random_seed",
          "min_tokens_to_generate", "add_BOS"]


def random_body(rng: random.Random) -> bytes:
    """Mostly near-valid requests with one or two fields garbled, some raw junk."""
    roll = rng.random()
    if roll < 0.15:
        return bytes(rng.randrange(256) for _ in range(rng.randint(0, 64)))
    if roll < 0.25:
        text = json.dumps({"prompts": ["1 2 3"], "tokens_to_generate": 2})
        return text[: rng.randint(0, len(text))].encode()
    body: dict = {"prompts": [" ".join(str(rng.randrange(VOCAB)) for _ in range(rng.randint(1, 6)))],
                  "tokens_to_generate": rng.randint(1, 4)}
    for _ in range(rng.randint(0, 3)):
        body[rng.choice(FIELDS + ["bogus"])] = random_value(rng)
    if rng.random() < 0.3:  # a plausible sampling request
        body.update(temperature=rng.choice([1e-300, 1e-8, 0.3, 1.0, 50.0]), top_p=rng.choice([0, 0.5, 1]),
                    top_k=rng.choice([0, 1, 5, VOCAB]), random_seed=rng.randint(0, 9))
    return json.dumps(body).encode()  # NaN and Infinity go out as the bare tokens json.loads accepts


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    checkpoint = tiny_checkpoint(str(tmp_path_factory.mktemp("tiny")))
    port = free_port()
    server = start_server(checkpoint, port)
    yield checkpoint, port, server
    server.stop()


def test_random_and_malformed_requests_are_answered_and_the_server_keeps_serving(served):
    checkpoint, port, server = served
    normal = {"prompts": ["5 9 13", "7"], "tokens_to_generate": 4, "top_k": 1}
    loaded = load_inference_model(checkpoint, ParallelState.single_process(torch.device("cpu")))
    expected = [g[0].token_ids for g in generate(loaded.model, [[5, 9, 13], [7]], GenerationParams(max_new_tokens=4),
                                                   eod=loaded.eod, vocab_size=loaded.vocab_size)]
    status, first = send(port, "PUT", "/api", json.dumps(normal).encode())
    assert status == 200 and first["tokens"] == expected

    # The reproductions: each once took the server down or left the client without an answer.
    tiny_t = {"prompts": ["1 2 3"], "tokens_to_generate": 4, "temperature": 1e-300}
    status, reply = send(port, "PUT", "/api", json.dumps(tiny_t).encode())
    assert status == 200 and len(reply["tokens"][0]) == 4, reply
    status, reply = send(port, "PUT", "/api", b'{"prompts": ["1 2 3"], "tokens_to_generate": 4, "temperature": NaN}')
    assert status == 400 and "temperature must be a finite number" in reply["message"]
    for method in ("DELETE", "PATCH", "GET", "POST", "OPTIONS"):
        assert send(port, method, "/api", b"{}")[0] == 405
    assert send(port, "PUT", "/elsewhere", b"{}")[0] == 404
    assert send(port, "PUT", "/api", b"{}", {"Content-Length": "x"})[0] in (400, 411)

    rng = random.Random(18)
    statuses: dict[int, int] = {}
    for _ in range(300):
        status, _ = send(port, "PUT", "/api", random_body(rng))
        statuses[status] = statuses.get(status, 0) + 1
        assert server.poll() is None, "the server died"
    assert set(statuses) <= {200, 400}, statuses  # every refusal is a validation error, never a crash
    assert statuses.get(200, 0) >= 20 and statuses.get(400, 0) >= 100, statuses  # the mix reached both sides
    assert send(port, "PUT", "/api", json.dumps(normal).encode()) == (200, first)


OPENAI_FIELDS = ["prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed", "logprobs", "echo",
                 "model", "presence_penalty", "stream_options", "messages", "top_logprobs", "max_completion_tokens"]


def random_openai_body(rng: random.Random, chat: bool) -> bytes:
    """Near-valid /v1 requests (never streamed: the answer must be JSON) with fields garbled, some raw junk."""
    if rng.random() < 0.1:
        return bytes(rng.randrange(256) for _ in range(rng.randint(0, 64)))
    ids = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))]
    body: dict = {"max_tokens": rng.randint(0, 4), "temperature": rng.choice([0, 0.7, 1.0])}
    if chat:
        body["messages"] = [{"role": "user", "content": " ".join(map(str, ids))}]
    else:
        body["prompt"] = rng.choice([" ".join(map(str, ids)), ids, [ids, ids[:1]]])
        body.update(rng.choice([{}, {"logprobs": rng.randint(0, 3), "echo": rng.random() < 0.5}]))
    for _ in range(rng.randint(0, 3)):
        body[rng.choice(OPENAI_FIELDS + ["bogus"])] = random_value(rng)
    body["stream"] = False
    return json.dumps(body).encode()


def test_random_openai_requests_are_answered_in_openai_shape_and_the_server_keeps_serving(served):
    checkpoint, port, server = served
    valid = {"prompt": [5, 9, 13], "max_tokens": 4, "temperature": 0}
    status, first = send(port, "POST", "/v1/completions", json.dumps(valid).encode())
    assert status == 200 and first["choices"][0]["finish_reason"] in ("length", "stop")
    assert send(port, "GET", "/health", None) == (200, {"status": "ok"})
    assert send(port, "GET", "/v1/models", None)[1]["data"][0]["object"] == "model"
    assert send(port, "POST", "/v1/elsewhere", b"{}")[0] == 404
    assert send(port, "PUT", "/v1/completions", b"{}")[0] == 405
    rng = random.Random(31)
    statuses: dict[int, int] = {}
    for i in range(200):
        path = "/v1/chat/completions" if i % 3 == 0 else "/v1/completions"
        status, _ = send(port, "POST", path, random_openai_body(rng, path.endswith("chat/completions")))
        statuses[status] = statuses.get(status, 0) + 1
        assert server.poll() is None, "the server died"
    assert set(statuses) <= {200, 400}, statuses  # every refusal is a validation error, never a crash
    assert statuses.get(200, 0) >= 20 and statuses.get(400, 0) >= 50, statuses  # the mix reached both sides
    again = send(port, "POST", "/v1/completions", json.dumps(valid).encode())[1]
    assert again["choices"] == first["choices"]


def raw_exchange(port: int, data: bytes, end_input: bool = True) -> tuple[int, str]:
    """Send ``data`` as is (then end the input, unless ``end_input`` is False: a client that waits) and read one
    answer, which must have a status line and a JSON body, with a message unless it is a 200; return (status,
    message)."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(data)
        if end_input:
            sock.shutdown(socket.SHUT_WR)
        response = http.client.HTTPResponse(sock)
        response.begin()  # BadStatusLine when the answer has no status line
        body = response.read()
    assert response.getheader("Content-Type") == "application/json", (data[:80], response.status, body[:200])
    reply = json.loads(body)
    assert response.status == 200 or reply.get("message"), (data[:80], response.status, reply)
    return response.status, reply.get("message", "")


def put(body: bytes, length: bytes | None = None, headers: bytes = b"") -> bytes:
    """A raw ``PUT /api`` request with ``body`` and the Content-Length ``length`` (default: the body's)."""
    length = str(len(body)).encode() if length is None else length
    return b"PUT /api HTTP/1.1\r\nHost: x\r\n" + headers + b"Content-Length: " + length + b"\r\n\r\n" + body


VALID = b'{"prompts": ["1 2 3"], "tokens_to_generate": 1}'
NESTED_FIELD = b'{"prompts": ["1"], "tokens_to_generate": 1, "temperature": ' + b"[" * 500 + b"]" * 500 + b"}"
# (request, end the input, status, part of the message); each was once a 500, a silence, an answer without a
# status line, a 200 or a wait until the socket timed out.
MALFORMED_HTTP = {
    "nested json": (put(b"[" * 100_000), True, 400, "too deeply"),
    "nested field": (put(NESTED_FIELD), True, 400, "temperature must be a number, got a JSON array"),
    "HTTP/0.9 PUT with a body": (b"PUT /api\r\nContent-Length: 2\r\n\r\n{}", True, 400, "Bad HTTP/0.9 request"),
    "HTTP/0.9 GET": (b"GET /api\r\n", True, 405, "GET is not supported"),
    "one word": (b"PUT\r\nContent-Length: 2\r\n\r\n{}", True, 400, "Bad request syntax"),
    "four words": (b"PUT /api HTTP/1.1 x\r\nContent-Length: 2\r\n\r\n{}", True, 400, "Bad request version"),
    "bad version": (b"PUT /api HTTP/one\r\nContent-Length: 2\r\n\r\n{}", True, 400, "Bad request version"),
    "binary request line": (b"\x00\xff\xfe \x01\r\n\r\n", True, 400, "Bad HTTP/0.9 request"),
    "blank request line": (b"  \t \r\nContent-Length: 2\r\n\r\n{}", True, 400, "request line is blank"),
    "CR-only line ends": (b"PUT /api HTTP/1.1\rHost: x\rContent-Length: 2\r\r{}", False, 400, "bare CR"),
    "a CR-only header": (put(b"{}", headers=b"Host: y\rX: 1\r\n"), False, 400, "bare CR"),
    "body shorter than its length": (put(VALID, b"200"), True, 400, f"ended after {len(VALID)} of its Content-Length"),
    "length with an underscore": (put(b"{}", b"0_2"), True, 400, "Content-Length must be one number"),
    "signed length": (put(b"{}", b"+2"), True, 400, "Content-Length must be one number"),
    "two lengths": (put(b"{}", headers=b"Content-Length: 3\r\n"), True, 400, "Content-Length must be one number"),
    "chunked": (put(b"{}", headers=b"Transfer-Encoding: chunked\r\n"), True, 411, "Transfer-Encoding"),
    "no length": (b"PUT /api HTTP/1.1\r\nHost: x\r\n\r\n", True, 411, "Content-Length is required"),
    "unknown method": (b"BREW /api HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}", True, 405, "BREW is not supported"),
    "head that stops": (b"PUT /api HTTP/1.1\r\nContent-Len", False, 408, f"within {REQUEST_TIMEOUT} s"),
    "request line that stops": (b"PUT /api HT", False, 408, f"within {REQUEST_TIMEOUT} s"),
    "body that stops": (put(VALID[:10], str(len(VALID)).encode()), False, 408, f"within {REQUEST_TIMEOUT} s"),
}


def mutated(rng: random.Random, request: bytes) -> bytes:
    """``request`` with one to three bytes replaced, deleted or inserted (line ends and NULs favoured), or cut."""
    data = bytearray(request)
    for _ in range(rng.randint(1, 3)):
        at = rng.randrange(len(data))
        byte = rng.choice([b"\r", b"\n", b" ", b"\x00", b":", bytes([rng.randrange(256)])])
        kind = rng.choice(["replace", "delete", "insert", "cut"])
        if kind == "replace":
            data[at : at + 1] = byte
        elif kind == "delete" and len(data) > 1:
            del data[at]
        elif kind == "insert":
            data[at:at] = byte
        elif kind == "cut":
            data = data[: max(at, 1)]
    return bytes(data)


def test_malformed_http_gets_a_status_line_and_json_and_the_server_keeps_serving(served):
    checkpoint, port, server = served
    normal = json.dumps({"prompts": ["5 9 13"], "tokens_to_generate": 4, "top_k": 1}).encode()
    status, first = send(port, "PUT", "/api", normal)
    assert status == 200
    # The requests that stop coming wait for --request-timeout: they wait at once, on connections of their own
    # (one server thread each), while the other requests are answered.
    with ThreadPoolExecutor(len(MALFORMED_HTTP)) as pool:
        exchanges = {name: pool.submit(raw_exchange, port, request, end_input)
                     for name, (request, end_input, expected_status, _) in MALFORMED_HTTP.items()
                     if expected_status == 408}
        for name, (request, end_input, _, _) in MALFORMED_HTTP.items():
            if name not in exchanges:
                exchanges[name] = pool.submit(raw_exchange, port, request, end_input)
                exchanges[name].result()  # one at a time, as a client would send them
        for name, (_, _, expected_status, expected_message) in MALFORMED_HTTP.items():
            status, message = exchanges[name].result()
            assert (status, expected_message in message) == (expected_status, True), (name, status, message)
    # A body over the limit, more than the loopback buffers hold, from a client that reads the answer only once its
    # body is out: the server drains it after answering (closing on unread bytes resets the client's send).
    status, reply = send(port, "PUT", "/api", b" " * (8 << 20))
    assert status == 400 and "exceeds the limit" in reply["message"]

    rng = random.Random(25)
    statuses: dict[int, int] = {}
    for _ in range(60):
        request = mutated(rng, put(VALID))
        if not request.strip(b"\r\n"):
            continue  # nothing but empty lines: no request to answer
        status, _ = raw_exchange(port, request)
        statuses[status] = statuses.get(status, 0) + 1
    assert all(status == 200 or 400 <= status < 500 or status == 505 for status in statuses), statuses
    assert 200 in statuses and 400 in statuses, statuses  # the mutations reached both sides
    assert server.poll() is None, "the server died"
    assert send(port, "PUT", "/api", normal) == (200, first)
