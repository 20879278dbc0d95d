"""Serving throughput and latency with 1, 4 and 16 concurrent clients: continuous batching vs one at a time.

    python benchmarks/serving.py                         # GPT 4L/256/8 heads, vocabulary 1024, 256 positions
    python benchmarks/serving.py --clients 1 4 16 --requests-per-client 4 --new-tokens 64 --threads 2

Builds a model with random weights (a checkpoint without a tokenizer: prompts are token ids, and nothing ends a
sequence early, so every request generates exactly ``--new-tokens``), starts ``tools/text_generation_server.py``
on one process, and for each client count runs two modes, each client sending ``--requests-per-client``
requests back to back with a ``--prompt-length`` prompt of random ids:

* ``one at a time``: ``PUT /api``, which the server runs whole, one request after the other (today's behaviour
  before continuous batching, and still that of the legacy endpoint);
* ``batched``: ``POST /v1/completions`` with ``stream: true``; requests join the running batch at its next step.

Per mode and load: generated tokens/s over the whole run (wall clock), the median time to first token (for
``PUT /api`` the whole request: it answers only at the end), the median per-token latency of a request after
its first token, and the server process's CPU time per generated token (all its threads, from ``/proc``; Linux
only). Prints a markdown table and the ratio of batched to one-at-a-time throughput at each load, by wall clock
and by server CPU time: on a machine shared with other work the wall-clock figures move with the load (the
one-request path, a chain of short steps, loses more to it), while the CPU time a token costs moves much less.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_checkpoint(root: str, layers: int, hidden: int, heads: int, vocab: int, positions: int) -> str:
    """A GPT with random weights saved at iteration 0 (mock data: no tokenizer)."""
    import torch

    from megatron_like.config import parse_config
    from megatron_like.model import GPTModel
    from megatron_like.parallel_state import ParallelState
    from megatron_like.training.checkpointing import save_checkpoint

    flags = ["--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
             "--seq-length", str(positions), "--max-position-embeddings", str(positions), "--mock-data",
             "--vocab-size", str(vocab), "--ckpt-format", "torch", "--save", root]
    config = parse_config(flags, world_size=1)
    model = GPTModel(config.model, ParallelState.single_process(torch.device("cpu")),
                     vocab_size=config.padded_vocab_size(vocab), seed=1)
    save_checkpoint(root, 0, config, ParallelState.single_process(torch.device("cpu")), [model], None, None, 0)
    return root


def one_at_a_time(port: int, prompt: list[int], new_tokens: int) -> tuple[float, float, float]:
    """(seconds to the whole answer, time to first token = the same, per-token latency) of one PUT /api."""
    body = json.dumps({"prompts": [" ".join(map(str, prompt))], "tokens_to_generate": new_tokens, "top_k": 1})
    start = time.perf_counter()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    connection.request("PUT", "/api", body=body, headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    reply = json.loads(response.read())
    connection.close()
    elapsed = time.perf_counter() - start
    assert response.status == 200 and len(reply["tokens"][0]) == new_tokens, reply
    return elapsed, elapsed, elapsed / new_tokens


def streamed(port: int, prompt: list[int], new_tokens: int) -> tuple[float, float, float]:
    """(seconds to the end, time to first token, per-token latency after it) of one streamed /v1/completions."""
    body = json.dumps({"prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": True})
    start = time.perf_counter()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    connection.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200, response.read()
    first, pieces = None, 0
    for line in response:
        if line.startswith(b"data: {"):
            event = json.loads(line[6:])
            if event["choices"] and event["choices"][0]["text"]:
                first = first or time.perf_counter()
                pieces += len(event["choices"][0]["text"].split())
    end = time.perf_counter()
    connection.close()
    assert pieces == new_tokens, (pieces, new_tokens)
    return end - start, first - start, (end - first) / max(1, new_tokens - 1)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far, all threads (nan where ``/proc`` is missing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return math.nan
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def run_load(port: int, mode, clients: int, requests: int, prompt_length: int, new_tokens: int, vocab: int,
             server_pid: int) -> dict:
    """Every client sends ``requests`` requests back to back; throughput, median latencies, server CPU per token."""
    records: list[tuple[float, float, float]] = []
    lock = threading.Lock()

    def client(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(requests):
            result = mode(port, [rng.randrange(vocab) for _ in range(prompt_length)], new_tokens)
            with lock:
                records.append(result)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    start, cpu_start = time.perf_counter(), cpu_seconds(server_pid)
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall, cpu = time.perf_counter() - start, cpu_seconds(server_pid) - cpu_start
    tokens = clients * requests * new_tokens
    return {"tokens_per_s": tokens / wall,
            "ttft_ms": 1000 * statistics.median(r[1] for r in records),
            "per_token_ms": 1000 * statistics.median(r[2] for r in records),
            "cpu_ms_per_token": 1000 * cpu / tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--positions", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the server (OMP_NUM_THREADS).")
    parser.add_argument("--port", type=int, default=5731)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        checkpoint = make_checkpoint(root, args.layers, args.hidden, args.heads, args.vocab, args.positions)
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        server = subprocess.Popen([sys.executable, os.path.join(ROOT, "tools", "text_generation_server.py"), "--load",
                                   checkpoint, "--port", str(args.port), "--max-batch-size", str(max(args.clients)),
                                   "--max-tokens-to-generate", str(args.new_tokens)], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 300
            while True:
                try:
                    connection = http.client.HTTPConnection("127.0.0.1", args.port, timeout=5)
                    connection.request("GET", "/health")
                    if connection.getresponse().status == 200:
                        break
                except OSError:
                    if server.poll() is not None or time.monotonic() > deadline:
                        raise SystemExit("the server did not start") from None
                    time.sleep(0.5)
            for mode in (one_at_a_time, streamed):  # warm-up: first-call costs (weight packing, allocations)
                mode(args.port, list(range(args.prompt_length)), 4)
            rows = []
            for clients in args.clients:
                for name, mode in (("one at a time (PUT /api)", one_at_a_time), ("batched (/v1, streamed)", streamed)):
                    result = run_load(args.port, mode, clients, args.requests_per_client, args.prompt_length,
                                      args.new_tokens, args.vocab, server.pid)
                    rows.append((clients, name, result))
                    print(f"clients {clients:3d} | {name:26s} | {result['tokens_per_s']:8.1f} tokens/s | TTFT "
                          f"{result['ttft_ms']:8.1f} ms | per token {result['per_token_ms']:7.2f} ms | server CPU "
                          f"{result['cpu_ms_per_token']:6.2f} ms/token", flush=True)
        finally:
            server.terminate()
            server.wait(timeout=60)
    print(f"\nGPT {args.layers}L/{args.hidden}/{args.heads} heads, vocabulary {args.vocab}, prompt "
          f"{args.prompt_length}, {args.new_tokens} new tokens, {args.requests_per_client} requests per client, "
          f"{args.threads} thread(s)\n")
    print("| clients | mode | generated tokens/s | median TTFT (ms) | median per-token latency (ms) | "
          "server CPU per token (ms) |")
    print("|---|---|---|---|---|---|")
    for clients, name, result in rows:
        print(f"| {clients} | {name} | {result['tokens_per_s']:.1f} | {result['ttft_ms']:.1f} | "
              f"{result['per_token_ms']:.2f} | {result['cpu_ms_per_token']:.2f} |")
    print()
    singles = {c: r for c, n, r in rows if n.startswith("one")}
    for clients, name, result in rows:
        if name.startswith("batched"):
            alone = singles[clients]
            print(f"{clients} clients: batched / one at a time = {result['tokens_per_s'] / alone['tokens_per_s']:.2f}x "
                  f"by wall clock, {alone['cpu_ms_per_token'] / result['cpu_ms_per_token']:.2f}x by server CPU per "
                  f"token; batched / one-at-a-time with 1 client = "
                  f"{result['tokens_per_s'] / singles[min(singles)]['tokens_per_s']:.2f}x")


if __name__ == "__main__":
    main()
