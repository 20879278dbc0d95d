"""Clients that leave (tools/text_generation_server.py over megatron_like/inference/scheduler.py): a real socket
closed mid-stream, or before a plain answer, or while its prompt still waits for a slot, stops that request: its
slot is free at the next step (scheduler, cache and last token), nothing more is generated for it, and the request
beside it gets the tokens it gets alone. A burst of simultaneous connections is taken into the listen backlog at
once. The HTTP server runs in this process and the test steps the engine itself, so every step is seen."""

from __future__ import annotations

import json
import os
import runpy
import select
import socket
import threading
import time

import pytest

from megatron_like.inference.batching import BatchEngine
from megatron_like.inference.openai_api import ChatTemplate
from megatron_like.inference.scheduler import Job, Sampling, Scheduler
from tests.e2e.cli import ROOT
from tests.unit.test_continuous_batching import alone, tiny_loaded

SERVER = runpy.run_path(os.path.join(ROOT, "tools", "text_generation_server.py"))


@pytest.fixture(scope="module")
def loaded():
    return tiny_loaded("gpt2")


@pytest.fixture
def served(loaded):
    """(scheduler, port) of an HTTP server with two slots whose engine loop is the test's to step."""
    server = SERVER["Server"](loaded, SERVER["Limits"](max_batch_size=2), None, "tiny", ChatTemplate())
    server.scheduler = Scheduler(loaded, BatchEngine(loaded, slots=2), server.decode, max_queued=8)
    http = SERVER["HttpServer"](("127.0.0.1", 0), SERVER["make_handler"](server, 30.0))
    thread = threading.Thread(target=http.serve_forever, args=(0.05,), daemon=True)  # quick to shut down
    thread.start()
    yield server.scheduler, http.server_address[1]
    http.shutdown()
    http.server_close()


def until(condition, what: str) -> None:
    """Wait for a handler thread to do its part (bounded: a handler that never does it fails the test)."""
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.01)


def post(port: int, body: dict) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return sock


def job_of(scheduler: Scheduler, ids: list[int]) -> Job | None:
    with scheduler.condition:  # a handler thread may be queueing meanwhile
        jobs = list(scheduler.pending) + [job for job, _ in scheduler.active.values()]
    return next((job for job in jobs if job.ids == ids), None)


def slot_is_free(scheduler: Scheduler, slot: int) -> bool:
    engine = scheduler.engine
    return slot not in scheduler.active and slot not in engine.last_token and engine.cache.lengths[slot] == 0


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_frees_its_slot_at_the_next_step(served, loaded, stream):
    scheduler, port = served
    neighbour = Job([7, 1], Sampling(max_tokens=8, temperature=0))
    scheduler.submit([neighbour])
    sock = post(port, {"prompt": [5, 9, 13], "max_tokens": 20, "temperature": 0, "stream": stream})
    until(lambda: job_of(scheduler, [5, 9, 13]) is not None, "the request was queued")
    leaving = job_of(scheduler, [5, 9, 13])
    scheduler.step()  # both prefilled together
    scheduler.step()
    slot = leaving.choices[0].slot
    assert len(leaving.choices[0].tokens) == 2 and scheduler.active[slot][0] is leaving
    if stream:  # the client reads the headers and the first event, then leaves mid-stream
        received = b""
        while b"data: {" not in received:  # the headers may come alone; the socket's timeout bounds the wait
            chunk = sock.recv(65536)
            assert chunk, f"the server closed the stream: {received!r}"
            received += chunk
    sock.close()
    while not leaving.cancelled and not leaving.done:  # the engine goes on: the handler wakes at each step
        scheduler.step()
        time.sleep(0.01)
    assert leaving.cancelled, "the handler never saw the client leave"
    generated = len(leaving.choices[0].tokens)
    assert generated < 20 and slot not in scheduler.step()  # the next step: freed on the engine, no token for it
    assert slot_is_free(scheduler, slot) and len(leaving.choices[0].tokens) == generated
    while not neighbour.done:
        scheduler.step()
    assert neighbour.choices[0].tokens == alone(loaded, [7, 1], 8)


def test_a_client_that_leaves_while_queued_is_never_admitted(served):
    scheduler, port = served
    running = [Job([7], Sampling(max_tokens=4, temperature=0)), Job([8], Sampling(max_tokens=4, temperature=0))]
    scheduler.submit(running)
    scheduler.step()  # both slots taken
    sock = post(port, {"prompt": [5, 9, 13], "max_tokens": 4, "temperature": 0, "stream": True})
    until(lambda: job_of(scheduler, [5, 9, 13]) is not None, "the request was queued")
    queued = job_of(scheduler, [5, 9, 13])
    sock.close()
    until(lambda: queued.cancelled, "the handler saw the client leave")
    while not all(job.done for job in running):
        scheduler.step()
    assert not scheduler.pending and queued.choices[0].slot is None  # dropped from the queue, never given a slot
    assert all(slot_is_free(scheduler, slot) for slot in range(2))
    answered = Job([5, 9, 13], Sampling(max_tokens=2, temperature=0))  # the server serves on
    scheduler.submit([answered])
    while not answered.done:
        scheduler.step()
    assert len(answered.choices[0].tokens) == 2


def test_a_burst_of_connections_is_taken_into_the_backlog_at_once(loaded):
    """32 clients connect to a server that has not accepted any yet: all are taken (socketserver's default backlog
    of 5 takes 6; the others would wait for their TCP retry, a second later, and again while it stays full)."""
    handler = SERVER["make_handler"](SERVER["Server"](loaded, SERVER["Limits"](), None, "tiny", ChatTemplate()))
    http = SERVER["HttpServer"](("127.0.0.1", 0), handler)  # listening, never accepting
    sockets = [socket.socket() for _ in range(32)]
    try:
        for sock in sockets:
            sock.setblocking(False)
            sock.connect_ex(http.server_address)
        connecting, deadline = set(sockets), time.monotonic() + 2.5
        while connecting and time.monotonic() < deadline:
            connecting -= set(select.select([], list(connecting), [], 0.1)[1])
        assert not connecting, f"{len(connecting)} of 32 connections were left waiting"
        assert all(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0 for sock in sockets)
    finally:
        for sock in sockets:
            sock.close()
        http.server_close()
