"""Pipeline bubble: the measured idle fraction of each rank under 1F1B, interleaved 1F1B, ZB-H1, ZB-V and DualPipeV,
against the schedule's theory at the step times the same iteration measured.

    python benchmarks/pipeline_bubble.py                          # sleep stages, p in {2, 4}, v in {1, 2}
    python benchmarks/pipeline_bubble.py --work gpt --pp 2        # real GPT chunks (one core per rank)
    python benchmarks/pipeline_bubble.py --trace-dir /tmp/traces  # also write Chrome traces

Each layout runs the real schedules (``megatron_like.pipeline_parallel``) with gloo p2p on ``p`` processes and
records their trace: per step its span (compute, then issuing the p2p batch that follows it: ``comm``) and the
time it waited for its input before (``wait``). A rank is busy during its spans and during the executor's own time
between them (the gap less the wait: ``overhead``); it is idle while it waits, and before its first and after its
last step in the iteration's window (first start to last end over all ranks). Measured bubble: the mean idle
share of the ranks.

Theory (``analyse``): the event simulator (``trace.simulate``) replays the ranks' orders, with the communication
plan the executor used, each step lasting exactly the busy time it took in this iteration (so a step slowed by
the loaded machine slows the theory too), and messages instantaneous (``theory``) or taking the median latency
measured in the trace (``theory+lat``: from a send's hand-off to the end of the wait of a receiver that was
already waiting). ``formula`` is the closed form at the mean F, B, W times (``(p - 1) / (v m + p - 1)``,
``zero_bubble.zb_h1_bubble``, ``v_schedules.zb_v_bubble``; DualPipeV's simulated order at those times), which
the simulator reproduces exactly at uniform times (``tests/distributed/test_zero_bubble_schedules.py``). Each
layout runs ``--iterations`` timed iterations; the row is the one with the median ratio measured / theory.
``tests/unit/test_pipeline_bubble_analysis.py`` checks the analysis on simulated traces of known latency.

``--work sleep`` (default) gives every stage a forward of ``--forward-ms`` and a backward of twice that
(divided among its ``v`` chunks) as sleeps, half of it the weight gradients (ZB-H1's W), so the measurement
isolates the schedule and its communication from CPU contention: this machine has 2 cores and the processes
of p = 4 would otherwise steal each other's cycles. ``--work gpt`` runs GPT chunks (8 layers split over the
stages), meaningful when every rank has its own core. """

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import statistics
import sys
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_like.config import ParallelConfig, parse_config  # noqa: E402
from megatron_like.model import chunk_layers  # noqa: E402
from megatron_like.parallel_state import ParallelState  # noqa: E402
from megatron_like.pipeline_parallel import ScheduleTrace, get_forward_backward_func  # noqa: E402
from megatron_like.pipeline_parallel.comm_plan import communication_plan, in_order_plans, sent_after  # noqa: E402
from megatron_like.pipeline_parallel.placement import ChunkPlacement  # noqa: E402
from megatron_like.pipeline_parallel.trace import (  # noqa: E402
    TraceEvent,
    chrome_trace,
    idle_fractions,
    input_source,
    simulate,
    theoretical_bubble,
)
from megatron_like.pipeline_parallel.v_schedules import dualpipev_steps, zb_v_bubble  # noqa: E402
from megatron_like.pipeline_parallel.zero_bubble import zb_h1_bubble  # noqa: E402
from megatron_like.tensor_parallel import weight_grad  # noqa: E402


class _Sleep(torch.autograd.Function):
    """``x * weight`` whose forward and backward take fixed times (a stand-in for a stage's compute). The
    backward's input-gradient part sleeps ``backward_s``, its weight-gradient part ``weight_s``: right away, or
    in the W step of a zero-bubble schedule (``weight_grad.defer``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, forward_s: float, backward_s: float,
                weight_s: float) -> torch.Tensor:
        ctx.backward_s, ctx.weight_s, ctx.weight = backward_s, weight_s, weight
        ctx.save_for_backward(x)
        time.sleep(forward_s)
        return x * weight

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, None, None, None]:
        (x,) = ctx.saved_tensors
        time.sleep(ctx.backward_s)

        def weight_grads() -> list[tuple[torch.Tensor, torch.Tensor]]:
            time.sleep(ctx.weight_s)
            return [(ctx.weight, (grad * x).sum())]

        if weight_grad.defer(weight_grads):
            return grad * ctx.weight, None, None, None, None
        return grad * ctx.weight, weight_grads()[0][1], None, None, None


class SleepChunk(nn.Module):
    """A pipeline chunk ``[s, b, h] -> [s, b, h]`` with the attributes the schedules read."""

    def __init__(self, ps: ParallelState, shape: tuple[int, int, int], forward_s: float, backward_s: float,
                 weight_s: float, pre_process: bool) -> None:
        super().__init__()
        self.ps, self.shape, self.pre_process = ps, shape, pre_process
        self.config = SimpleNamespace(seq_length=shape[0], hidden_size=shape[2])
        self.sequence_parallel = False
        self.forward_s, self.backward_s, self.weight_s = forward_s, backward_s, weight_s
        self.weight = nn.Parameter(torch.ones(()))
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        self.input_tensor = tensor

    def forward(self) -> torch.Tensor:
        x = torch.ones(self.shape) if self.pre_process else self.input_tensor
        return _Sleep.apply(x, self.weight, self.forward_s, self.backward_s, self.weight_s)


def sleep_forward_step(data_iterator, chunk: SleepChunk):
    next(data_iterator)
    output = chunk()
    return output, lambda out: (out.mean(), {"loss": out.mean().detach()})


V_SCHEDULES = ("zb-v", "dualpipev")


def build_sleep_chunks(ps: ParallelState, vp: int, args: argparse.Namespace, v_shape: bool = False):
    shape = (args.seq_length, args.micro_batch_size, args.hidden_size)
    forward_s = args.forward_ms / 1000 / vp
    # A backward of twice the forward, half of it the weight gradients (W = B = F, the paper's setting).
    return [SleepChunk(ps, shape, forward_s, forward_s, forward_s, ps.is_first_stage and c == 0) for c in range(vp)], \
        sleep_forward_step, itertools.repeat(None)


def build_gpt_chunks(ps: ParallelState, vp: int, args: argparse.Namespace, v_shape: bool = False):
    import pretrain_gpt
    from megatron_like.data.mock_dataset import MockGPTDataset

    config = parse_config([
        "--num-layers", str(args.gpt_layers), "--hidden-size", str(args.hidden_size), "--num-attention-heads", "8",
        "--seq-length", str(args.seq_length), "--micro-batch-size", str(args.micro_batch_size), "--mock-data",
        "--vocab-size", "1024", "--hidden-dropout", "0", "--attention-dropout", "0",
    ])
    placement = ChunkPlacement(ps.pp_size, vp, v_shape)
    chunks = [
        pretrain_gpt.model_provider(config, ps, layers=chunk_layers(args.gpt_layers, ps.pp_size, ps.pp_rank, vp, c,
                                                                    v_shape),
                                    pre_process=placement.is_first(ps.pp_rank, c),
                                    post_process=placement.is_last(ps.pp_rank, c), padded_vocab_size=1024)
        for c in range(vp)
    ]
    dataset = MockGPTDataset(10**6, args.seq_length, 1024, seed=1)
    b = args.micro_batch_size
    batches = ({"text": torch.stack([torch.from_numpy(dataset[i * b + j]["text"]) for j in range(b)])}
               for i in itertools.count())
    return chunks, pretrain_gpt.forward_step, batches


def schedule_bubble(name: str, p: int, v: int, m: int, times: dict[str, float]) -> float:
    """The schedule's closed-form idle fraction with these mean step times (a chunk's, on the V)."""
    if name == "zb-h1":
        return zb_h1_bubble(p, m, times["F"], times["B"], times["W"])
    if name == "zb-v":
        return zb_v_bubble(p, m, times["F"], times["B"], times["W"])
    if name == "dualpipev":
        events = simulate([dualpipev_steps(p, r, m) for r in range(p)], 2, times["F"], times["B"],
                          weight_time=times["W"], v_shape=True)
        return max(idle_fractions(events))
    return theoretical_bubble(p, v, m)


def busy_times(events: list[TraceEvent]) -> list[float]:
    """Each step's busy time on its rank: its span (compute and issuing its p2p batch) plus the executor's own time
    since the previous step, i.e. the gap minus the time spent blocked on the step's input."""
    busy, previous_end = [], None
    for event in events:
        overhead = 0.0 if previous_end is None else max(event.start - event.wait - previous_end, 0.0)
        busy.append(event.end - event.start + overhead)
        previous_end = event.end
    return busy


def message_latency(name: str, p: int, v: int, gathered: list[list[TraceEvent]],
                    sends: list[list[int]]) -> float:
    """Median seconds from a result's send (the hand-off of the step whose p2p batch carries it) to the end of the
    receiver's wait, over the messages their receiver was already waiting for (the others show no latency)."""
    placement = ChunkPlacement(p, v, name in V_SCHEDULES)
    index = [{e.step: i for i, e in enumerate(events)} for events in gathered]
    latencies = []
    for rank, events in enumerate(gathered):
        for event in events:
            source = input_source(placement, rank, event.step)
            if source is None or event.wait == 0.0 or source[0] == rank:
                continue
            sender = gathered[source[0]][sends[source[0]][index[source[0]][source[1]]]]
            sent_at = sender.end - sender.comm
            if event.start - event.wait <= sent_at:
                latencies.append(event.start - sent_at)
    return statistics.median(latencies) if latencies else 0.0


def analyse(name: str, p: int, v: int, m: int, gathered: list[list[TraceEvent]]) -> dict:
    """One iteration's measured bubble against the theory at its own step times (module docstring)."""
    orders = [[e.step for e in events] for events in gathered]
    v_shape = name in V_SCHEDULES
    posts = in_order_plans(orders, p, v, v_shape=True) if v_shape else \
        [communication_plan(order, p, rank, v) for rank, order in enumerate(orders)]
    sends = [sent_after(len(order), rank_posts) for order, rank_posts in zip(orders, posts)]
    busy = [busy_times(events) for events in gathered]
    window = max(e.end for ev in gathered for e in ev) - min(e.start for ev in gathered for e in ev)
    latency = message_latency(name, p, v, gathered, sends)

    def simulated(latency: float) -> float:
        return statistics.mean(idle_fractions(simulate(orders, v, sent_after=sends, v_shape=v_shape, durations=busy,
                                                       latency=latency)))

    steps = [e for ev in gathered for e in ev]
    times = {kind: statistics.mean(e.end - e.start - e.comm for e in steps if e.kind == kind)
             for kind in sorted({e.kind for e in steps}, key="FBW".index)}
    return {
        "measured": statistics.mean(1 - sum(b) / window for b in busy),
        "theory": simulated(0.0),
        "theory_latency": simulated(latency),
        "formula": schedule_bubble(name, p, v, m, times),
        "times": times,
        "latency": latency,
        "overhead": statistics.mean(b - (e.end - e.start) for bs, ev in zip(busy, gathered) for b, e in zip(bs, ev)),
        "comm": statistics.mean(e.comm for e in steps),
    }


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank: int, world_size: int, port: int, layouts: list[tuple[int, int]], args: argparse.Namespace,
           results: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    ps = ParallelState.initialize(ParallelConfig(pipeline_model_parallel_size=world_size), world_size)
    build = build_sleep_chunks if args.work == "sleep" else build_gpt_chunks
    for name, vp, m in layouts:
        chunks, forward_step_func, data = build(ps, vp, args, name in V_SCHEDULES)
        schedule = get_forward_backward_func(ps.pp_size, vp, name)
        timed = []  # every rank's events, per timed iteration
        for iteration in range(args.warmup + args.iterations):
            trace = ScheduleTrace()
            dist.barrier()
            schedule(forward_step_func, data, chunks, m, micro_batch_size=args.micro_batch_size,
                     seq_length=args.seq_length, trace=trace)
            gathered: list[list[TraceEvent]] = [None] * world_size  # type: ignore[list-item]
            dist.all_gather_object(gathered, trace.events)
            if iteration >= args.warmup:
                timed.append(gathered)
        if rank == 0:  # analysed here: a queue item must stay small (a child flushes it before it can exit)
            results.put((name, world_size, vp, m, [analyse(name, world_size, vp, m, gathered) for gathered in timed]))
            if args.trace_dir:
                os.makedirs(args.trace_dir, exist_ok=True)
                with open(os.path.join(args.trace_dir, f"{args.work}-{name}-p{world_size}-v{vp}-m{m}.json"), "w") as f:
                    json.dump(chrome_trace(timed[-1]), f)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", choices=("sleep", "gpt"), default="sleep")
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4], help="pipeline sizes p")
    parser.add_argument("--vp", type=int, nargs="+", default=[1, 2], help="virtual stages per rank v")
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev"],
                        help="--pipeline-schedule values (interleaved runs each v > 1, zb-v and dualpipev v = 2, "
                        "the others v = 1)")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8], help="micro batches m")
    parser.add_argument("--forward-ms", type=float, default=100.0, help="sleep work: forward time of a stage")
    parser.add_argument("--gpt-layers", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--trace-dir", default=None, help="write a Chrome trace of each layout's last iteration")
    args = parser.parse_args(argv)

    ctx = mp.get_context("spawn")
    rows = []
    for p in args.pp:
        layouts = [(name, v, m) for name in args.schedules for v in args.vp for m in args.microbatches
                   if (v > 1) == (name == "interleaved") and (v == 1 or m % p == 0) and args.gpt_layers % (p * v) == 0]
        layouts += [(name, 2, m) for name in args.schedules if name in V_SCHEDULES for m in args.microbatches
                    if args.gpt_layers % (2 * p) == 0]
        layouts = [layout for layout in layouts if not (layout[0] in V_SCHEDULES and layout[1] == 1)]
        results = ctx.Queue()
        mp.start_processes(worker, args=(p, free_port(), layouts, args, results), nprocs=p,
                           start_method="spawn")
        rows += [results.get() for _ in layouts]

    sleep = f" ({args.forward_ms:g} ms forward per stage)" if args.work == "sleep" else ""
    print(f"pipeline bubble, work={args.work}" + sleep + f", median of {args.iterations} iterations, "
          f"{time.strftime('%Y-%m-%d')}, torch {torch.__version__}, {os.cpu_count()} cores, "
          f"load {os.getloadavg()[0]:.1f}")
    print(f"{'schedule':>11} {'p':>2} {'v':>2} {'m':>3} | {'F/B/W ms':>11} | {'formula':>7} | {'theory':>6} "
          f"{'measured':>8} {'ratio':>5} {'all iterations':>14} | {'latency ms':>10} {'theory+lat':>10} {'ratio':>5} | "
          f"{'overhead ms/step':>16} {'comm ms/step':>12}")
    for name, p, v, m, analyses in rows:
        # The iteration whose measured/theory ratio is the median (the ratio, not the bubble, is what is reported).
        iterations = sorted(analyses, key=lambda a: a["measured"] / a["theory"])
        a = iterations[len(iterations) // 2]
        fbw = "/".join(f"{t * 1000:.0f}" for t in a["times"].values())
        spread = f"{iterations[0]['measured'] / iterations[0]['theory']:.2f}-" \
                 f"{iterations[-1]['measured'] / iterations[-1]['theory']:.2f}"
        print(f"{name:>11} {p:>2} {v:>2} {m:>3} | {fbw:>11} | {a['formula']:7.3f} | {a['theory']:6.3f} "
              f"{a['measured']:8.3f} {a['measured'] / a['theory']:5.2f} {spread:>14} | {a['latency'] * 1000:10.2f} "
              f"{a['theory_latency']:10.3f} {a['measured'] / a['theory_latency']:5.2f} | "
              f"{a['overhead'] * 1000:16.2f} {a['comm'] * 1000:12.2f}")


if __name__ == "__main__":
    main()
