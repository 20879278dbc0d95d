"""When a pipeline rank sends its results and posts its receives: the communication plan.

A rank's steps are cut into slots, and after each slot one batch of p2p operations sends the slot's results and
posts the receives of the next slot (:func:`communication_plan`, Megatron's batching). NCCL runs the batches of
a rank in order on one stream and a batch ends only when its peers have posted the matching operations, so
which operations share a batch decides whether the pipeline can deadlock (``trace.simulate_in_order_batches``
models that rule; the tests run it on every layout).

On the ring (1F1B, interleaved, ZB-H1) Megatron's batching is safe as it is. On the V (ZB-V, DualPipeV) two
neighbours exchange messages in both directions on both chunks, and a rank's warmup forwards can run ahead of
what its neighbour is ready to receive: a result sent right after its step can hold the sender's batch while
the receiver first waits for something the sender would send only after that batch. :func:`in_order_plans`
replays all ranks' batches under the in-order rule and postpones such a send, one step at a time, until no
rank is stuck (a send can always wait; the receiver needs it no earlier than its own order says).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from megatron_like.pipeline_parallel.placement import ChunkPlacement
from megatron_like.pipeline_parallel.trace import Step


class Post(NamedTuple):
    """One batch of p2p operations, issued right after step ``after`` of a rank's order (-1: before the
    first step). ``sends`` and ``receives`` are indices of steps in that order: the steps whose result
    (a forward's output, a backward's input gradient) is sent, and the steps whose input is received."""

    after: int
    sends: tuple[int, ...]
    receives: tuple[int, ...]


def sent_after(num_steps: int, posts: Sequence[Post]) -> list[int]:
    """For each of a rank's ``num_steps`` steps, the step after which ``posts`` send its result (its own index when
    it sends nothing): ``trace.simulate``'s ``sent_after``."""
    after = list(range(num_steps))
    for post in posts:
        for i in post.sends:
            after[i] = post.after
    return after


def communication_plan(steps: Sequence[Step], pp_size: int, pp_rank: int, vp_size: int = 1,
                       v_shape: bool = False) -> list[Post]:
    """When each step of ``steps`` (the order of rank ``pp_rank``) sends its result and receives its input.

    A forward receives its input unless it runs the first stage and sends its output unless it runs the
    last stage (which computes the loss); a backward receives its output gradient unless it runs the last
    stage and sends its input gradient unless it runs the first. Where the two stages are chunks of this
    rank (the tip of the V, ``placement.py``) the result is handed over without a message. A W step
    (zero-bubble schedules) neither receives nor sends.

    The steps are cut into slots: one step each, except that with interleaving a forward and the
    backward right after it in the steady phase (after the warmup forwards) share a slot, and that W steps
    (which exchange nothing) join the slot of the step after them: the receive of that step is then posted
    with the sends of the step before them, in one batch (on the V two ranks otherwise each send a gradient
    and wait for the other to post its receive, which deadlocks under NCCL's in-order rule). After each
    slot one batch sends the slot's results and posts the receives of the next slot, so a receive is
    posted while the neighbour still computes the data. This is Megatron's batching
    (``send_forward_recv_backward`` for 1F1B, ``send_forward_backward_recv_forward_backward``
    interleaved), and it matters on NCCL, which runs a rank's batches in order on one stream: a batch
    posted early that waits for its peer blocks every later one. The tests prove this plan free of
    deadlocks under that rule for every layout (sending every result at once and receiving a step
    ahead is not) and show that it keeps the theoretical bubble.
    """
    placement = ChunkPlacement(pp_size, vp_size, v_shape)

    def receives_input(step: Step) -> bool:
        link = placement.input_link(pp_rank, step.kind, step.chunk)
        return link is not None and link.peer != 0

    def sends_result(step: Step) -> bool:
        link = placement.result_link(pp_rank, step.kind, step.chunk)
        return link is not None and link.peer != 0

    slots: list[list[int]] = [[]]
    for i, step in enumerate(steps):
        slots[-1].append(i)
        if step.kind != "W":  # a W step joins the slot of the step after it: see below
            slots.append([])
    slots = [slot for slot in slots if slot]
    forwards = sum(step.kind == "F" for step in steps)
    interleaved = vp_size > 1 and not v_shape and not any(step.kind == "W" for step in steps)
    if interleaved and forwards < len(steps):  # interleaved training: pair the steady phase
        warmup = interleaved_warmup(pp_size, pp_rank, forwards // vp_size, vp_size)
        cooldown = warmup + 2 * (forwards - warmup)
        slots = slots[:warmup] + [[i, i + 1] for i in range(warmup, cooldown, 2)] + slots[cooldown:]
    posts = []
    for k in range(-1, len(slots)):
        sends = tuple(i for i in slots[k] if sends_result(steps[i])) if k >= 0 else ()
        receives = tuple(i for i in slots[k + 1] if receives_input(steps[i])) if k + 1 < len(slots) else ()
        if sends or receives:
            posts.append(Post(slots[k][-1] if k >= 0 else -1, sends, receives))
    return posts


def interleaved_warmup(pp_size: int, pp_rank: int, num_microbatches: int, vp_size: int) -> int:
    """Forwards rank ``pp_rank`` runs before its first backward under interleaved 1F1B (Megatron's count)."""
    return min(num_microbatches * vp_size, 2 * (pp_size - pp_rank - 1) + (vp_size - 1) * pp_size)


def in_order_plans(orders: Sequence[Sequence[Step]], pp_size: int, vp_size: int = 1,
                   v_shape: bool = False) -> list[list[Post]]:
    """Every rank's plan (``orders[pp_rank]`` its steps), free of deadlocks under NCCL's in-order rule and with
    each pair of ranks' messages sent in the order they are received (NCCL ignores tags): the
    :func:`communication_plan` of each rank, on the V with the sends postponed that would hold a batch.

    The batches of all ranks are replayed under the in-order rule (``trace.simulate_in_order_batches``) with
    every message named by what it carries, so a send out of its peer's order waits like one whose receive is
    posted later. Whenever no running batch can end, one unfinished send of a running batch moves to the batch
    issued after the rank's next step, and the replay goes on from there (what ran before is unchanged). So
    every pair's messages also end up in the order the peer receives them; within a batch the sends go in that
    order too."""
    plans = [communication_plan(steps, pp_size, rank, vp_size, v_shape) for rank, steps in enumerate(orders)]
    if not v_shape:
        return plans
    names = _message_names(orders, ChunkPlacement(pp_size, vp_size, v_shape))
    # Per rank, its batches in order: [after, {message: ("send" | "recv", step index)}].
    batches = [[[post.after, {names[rank][(kind, i)]: (kind, i) for kind, group in (("send", post.sends),
                                                                                   ("recv", post.receives))
                              for i in group}] for post in plan] for rank, plan in enumerate(plans)]
    for rank_batches in batches:
        _align(rank_batches)
    position, completed = [0] * pp_size, set()
    while any(position[rank] < len(batches[rank]) for rank in range(pp_size)):
        running = [batches[r][position[r]][1] if position[r] < len(batches[r]) else {} for r in range(pp_size)]
        for rank, batch in enumerate(running):
            completed |= {m for m in batch if m in running[m[1] if m[0] == rank else m[0]]}
        finished = [rank for rank in range(pp_size)
                    if position[rank] < len(batches[rank]) and set(running[rank]) <= completed]
        if finished:
            for rank in finished:
                position[rank] += 1
            continue
        rank, message = next(((rank, m) for rank, batch in enumerate(running)
                              for m, (kind, _) in sorted(batch.items()) if kind == "send" and m not in completed),
                             (None, None))
        if rank is None:
            raise RuntimeError(f"p2p batches deadlock on receives alone: ranks stuck at batches {position}")
        _postpone(batches[rank], position[rank], message, len(orders[rank]))
    return [[Post(after, tuple(i for _, (kind, i) in sorted(batch.items()) if kind == "send"),
                  tuple(sorted(i for kind, i in batch.values() if kind == "recv")))
             for after, batch in rank_batches if batch] for rank_batches in batches]


def _align(batches: list[list]) -> None:
    """Postpone sends of one rank so that it sends to each peer in the order the peer receives: a message goes
    no earlier than the batch of the one its peer takes before it."""
    where = {m: k for k, (_, batch) in enumerate(batches) for m, (kind, _) in batch.items() if kind == "send"}
    latest: dict[int, int] = {}  # receiver -> batch of the last message placed
    for message in sorted(where):
        k = max(where[message], latest.get(message[1], 0))
        if k != where[message]:
            batches[k][1][message] = batches[where[message]][1].pop(message)
        latest[message[1]] = k


def _postpone(batches: list[list], k: int, message: tuple[int, int, int], num_steps: int) -> None:
    """Move ``message`` (a send) from batch ``k`` to the batch issued after the next step (made if needed)."""
    after = batches[k][0] + 1
    if after >= num_steps:
        raise RuntimeError(f"cannot postpone a send past the last step ({message})")
    if not (k + 1 < len(batches) and batches[k + 1][0] == after):
        batches.insert(k + 1, [after, {}])
    batches[k + 1][1][message] = batches[k][1].pop(message)


def _message_names(orders: Sequence[Sequence[Step]],
                   placement: ChunkPlacement) -> list[dict[tuple[str, int], tuple[int, int, int]]]:
    """Per rank, ``("send" | "recv", step index)`` -> the message's name ``(sender, receiver, k)``: the k-th
    the receiver takes from that sender, in its own order (the order NCCL must deliver them in)."""
    pp = placement.pp_size
    names: list[dict[tuple[str, int], tuple[int, int, int]]] = [{} for _ in range(pp)]
    wanted: dict[tuple[int, int], dict[Step, int]] = {}  # (sender, receiver) -> the sender's step -> k
    for rank, steps in enumerate(orders):
        for index, step in enumerate(steps):
            link = placement.input_link(rank, step.kind, step.chunk)
            if link is not None and link.peer != 0:
                stream = wanted.setdefault(((rank + link.peer) % pp, rank), {})
                names[rank][("recv", index)] = ((rank + link.peer) % pp, rank, len(stream))
                stream[Step(step.kind, link.chunk, step.microbatch)] = len(stream)
    for rank, steps in enumerate(orders):
        for index, step in enumerate(steps):
            link = placement.result_link(rank, step.kind, step.chunk)
            if link is not None and link.peer != 0:
                receiver = (rank + link.peer) % pp
                names[rank][("send", index)] = (rank, receiver, wanted[(rank, receiver)][step])
    return names
