"""One generation request on every rank of a model, with failures agreed by all ranks.

The HTTP server (``tools/text_generation_server.py``) validates a ``PUT /api`` request on rank 0 and broadcasts
it (in its engine loop's plan, ``scheduler.py``); then every rank calls :func:`serve_request`. Whatever a rank
raises while generating is caught, and the ranks agree (:func:`megatron_like.collectives.first_error`: an
all-reduce of the failing ranks, then the message of the lowest one) before rank 0 answers, so after a failed
request all ranks are back at the same point, waiting for the next one:

* a ``ValueError`` (a request the model cannot serve) becomes ``400`` with its message;
* anything else becomes ``500`` with the exception's type and message.

The ranks agree twice: after the local preparation (checks, weight packing), where a failure of any
one rank alone is recovered, and after generation, which recovers failures raised at the same step on
every rank (all request-dependent ones: every rank takes the same decisions on the same logits). A fault
of one rank alone *inside* generation (a device error on one GPU) leaves the others waiting in a
collective the faulty rank never joins: that ends as any hung collective does, after
``--distributed-timeout-minutes``, and torchrun stops the server.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megatron_like import collectives as comm
from megatron_like.inference.generation import GenerationParams, generate
from megatron_like.inference.loading import InferenceModel
from megatron_like.inference.packed_linear import ensure_packed


@dataclass
class Outcome:
    """What every rank knows after a request: ``status`` 200 with ``results``, or 4xx/5xx with ``message``."""

    status: int
    results: list | None = None
    message: str | None = None


def broadcast_request(request: dict | None, device: torch.device) -> dict | None:
    """Send rank 0's ``request`` (None = stop) to every rank; returns it everywhere.

    The bytes travel in tensors on ``device`` (the model's): NCCL broadcasts device tensors only.
    """
    group = comm.world_group()
    if group is None:
        return request
    payload = json.dumps(request).encode() if comm.group_rank(group) == 0 else b""
    size = comm.broadcast(torch.tensor([len(payload)], dtype=torch.long, device=device), 0, group)
    if payload:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    else:
        data = torch.empty(int(size), dtype=torch.uint8, device=device)
    comm.broadcast(data, 0, group)
    return json.loads(data.cpu().numpy().tobytes().decode())


def prepare_request(loaded: InferenceModel, request: dict) -> GenerationParams:
    """This rank's local work before generating (no collectives): check the parameters and prompts, pack
    the weights for the batch. Broadcast request: ``{"ids": [[int]], "params": GenerationParams fields}``."""
    params = GenerationParams(**request["params"]).validate()
    ids = request["ids"]
    if not ids or any(len(p) == 0 for p in ids) or any(not 0 <= t < loaded.vocab_size for p in ids for t in p):
        raise ValueError(f"every prompt needs token ids in [0, {loaded.vocab_size})")
    if request.get("prepack", True):
        ensure_packed(loaded.model, len(ids) * max(params.num_beams, params.num_return_sequences))
    return params


def attempt(work: Callable[[], Any]) -> tuple[Any, str | None]:
    """``(work(), None)``, or ``(None, "<status> <message>")`` when it raises."""
    try:
        return work(), None
    except ValueError as exc:
        return None, f"400 {exc}"
    except Exception as exc:  # noqa: BLE001 - any failure must be answered, and agreed by every rank
        return None, f"500 generation failed: {type(exc).__name__}: {exc}"


def serve_request(loaded: InferenceModel, request: dict, device: torch.device) -> Outcome:
    """Run ``request`` on this rank, agreeing with the others after each phase (call on every rank).

    Phase 1 (:func:`prepare_request`) is local, so a failure of one rank alone is agreed and answered.
    Phase 2 (``generate``) runs collectives; its failures are agreed when every rank raises at the same
    step (the module docstring says why that covers request-dependent failures).
    """
    group = comm.world_group()
    params, error = attempt(lambda: prepare_request(loaded, request))
    agreed = comm.first_error(error, group, device)
    if agreed is None:
        results, error = attempt(lambda: generate(loaded.model, request["ids"], params, eod=loaded.eod,
                                                    vocab_size=loaded.vocab_size))
        agreed = comm.first_error(error, group, device)
        if agreed is None:
            return Outcome(200, results)
    status, _, message = agreed.partition(" ")
    return Outcome(int(status), message=message)
