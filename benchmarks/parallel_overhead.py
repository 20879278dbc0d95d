"""Our hand-written parallelism against PyTorch's own, side by side in one run on 2 gloo processes.

    .venv/bin/python benchmarks/parallel_overhead.py                      # small sizes, every mode
    .venv/bin/python benchmarks/parallel_overhead.py --issue-sizes --modes dp zero3 --steps 3
    .venv/bin/python benchmarks/parallel_overhead.py --states-dominate --modes dp zero1 zero2 zero3 --steps 3

Modes (ours vs the PyTorch peer):

- ``dp``: ``DataParallel`` with overlapped bucketed all-reduce vs ``DistributedDataParallel``.
- ``zero1``: ``--zero-stage 1 --overlap-grad-reduce --overlap-param-gather`` vs DDP with
  ``ZeroRedundancyOptimizer`` (PyTorch's optimizer-state sharding; it broadcasts the updated params).
- ``zero2``: ``--zero-stage 2`` (same overlap flags) vs FSDP2 with ``reshard_after_forward=False`` (params kept
  gathered from forward to backward, gradients and optimizer states sharded: ZeRO-2 in FSDP2's terms).
- ``zero3`` / ``zero3-prefetch``: ``--zero-stage 3`` without / with ``--overlap-param-gather`` (and
  ``--overlap-grad-reduce``) vs FSDP2 ``fully_shard`` on every transformer layer and on the root (FSDP2
  always prefetches).

The data-parallel modes also run on 4 processes (``--world-size 4 --modes dp zero1 ...``); tp and pp on 2.
- ``tp``: ``--tensor-model-parallel-size 2 --sequence-parallel`` vs DTensor ``parallelize_module``
  (ColwiseParallel / RowwiseParallel / SequenceParallel, torchtitan's plan) with ``loss_parallel``.
- ``pp`` / ``pp-interleaved``: our 1F1B / interleaved 1F1B vs ``torch.distributed.pipelining``'s
  ``Schedule1F1B`` / ``ScheduleInterleaved1F1B``, 8 micro batches of one sample, one layer per virtual stage.
- ``pp-zb-h1``: our ``--pipeline-schedule zb-h1`` vs ``ScheduleInterleavedZeroBubble`` with one stage per rank
  (torch's zero-bubble schedule with input and weight backward split, the same placement as ours).
- ``pp-zb-v`` / ``pp-dualpipev``: our ``--pipeline-schedule zb-v`` / ``dualpipev`` vs ``ScheduleZBVZeroBubble`` /
  ``ScheduleDualPipeV``, two stages per rank placed in a V (rank r holds stages r and 2p - 1 - r) on both sides.

Both sides train the same architecture on the same tokens with the same AdamW (lr, betas, eps, weight decay
on matrices only) and gradient clipping at 1.0. dp and zero3 wrap our own ``GPTModel`` of one process (tied
head) in DDP / FSDP2; tp and pp compare with ``PlainGPT`` (untied head, no position table), which ours
matches with ``--untie-embeddings-and-output-weights --position-embedding-type none``.

The data-parallel modes add a third row, the *floor*: the peer's model and optimizer with no data parallelism
at all (each rank steps its own copy on its rows, nothing communicated), timed on every rank at once like the
other sides. No data-parallel implementation can be much faster than it (ZeRO's sharded step saves at most
half of AdamW's work), so the peer's speed against the floor is the most any implementation could gain over
the peer: when the peer already runs within 10% of the floor, issue 16's "1.1x the peer" cannot be met by the
parallelism, and that row is the measured reason.

Each process runs one thread. Per side, a profiled window builds the model and runs a warm-up step (the
optimizer states appear) and one measured step; then the timed steps alternate between the sides so a slow
period of the machine hits both. The table reports:

- ``s/step``: median over the timed steps of rank 0's wall time between barriers before and after the step.
- ``tokens/s``: global batch x sequence length / that median.
- ``CPU s/step/rank``: user + system CPU seconds of a rank's process (all its threads, gloo's included) over
  the same steps, median per rank, the busiest rank; far less disturbed by other load on the machine than wall
  time. ``speed vs peer`` gives both ratios (the peer's time / ours: above 1 means ours is faster).
  Printed after the table: minor page faults per step, the same way (fresh pages: on CPU a large temporary
  made anew each step costs its page faults every time).
- ``peak MiB/rank``: the most bytes of tensors alive at once during the measured step, from the profiler's
  allocation log (allocations minus frees since the side's construction: parameters, gradients,
  optimizer states and the step's transients; not the resident set); the largest over the ranks.
- ``sent MiB/rank``: bytes one rank sends during the measured step under the ring algorithms
  (``collectives.ring_bytes_sent``: all-reduce 2 (w-1)/w of the buffer, all-gather and reduce-scatter
  (w-1)/w of the full tensor, a point-to-point send its size); the largest over the ranks. Ours is counted
  inside ``megatron_like/collectives.py`` (``count_traffic``); the peer's by a dispatch mode that sees every
  ``c10d`` op (DDP's reducer, FSDP2, eager ``torch.distributed`` calls) and ``_c10d_functional`` op (DTensor).
- ``theory MiB/rank``: the textbook figure (``theory_bytes``): dp and ZeRO-1/2 ``2 x params x 4 bytes x
  (dp-1)/dp``, ZeRO-3 ``3 x``, a pipeline ``2v - 1`` activations per micro batch. Ours and FSDP2 send less
  than ``3 x`` at ZeRO-3: both keep the root (embedding, final norm) gathered from forward into backward.
  ``tests/distributed/test_parallel_overhead.py`` checks the counters against these.

Timings on a shared machine are noisy: compare the two sides' ratio from one run, not absolute figures.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_like import collectives as comm  # noqa: E402
from megatron_like.config import Config, ConfigError, parse_config  # noqa: E402
from megatron_like.model import GPTModel  # noqa: E402
from megatron_like.optimizer import param_groups  # noqa: E402
from megatron_like.parallel_state import ParallelState  # noqa: E402
from megatron_like.pipeline_parallel.placement import virtual_stage  # noqa: E402

MODES = ("dp", "zero1", "zero2", "zero3", "zero3-prefetch", "tp", "pp", "pp-interleaved", "pp-zb-h1", "pp-zb-v",
         "pp-dualpipev")
DATA_PARALLEL_MODES = ("dp", "zero1", "zero2", "zero3", "zero3-prefetch")  # these also run on 4 processes
# tp and pp compare with a plain GPT whose head is untied and which has no position table (DTensor's plan and
# the pipeline split are simplest that way); ours runs the same architecture through its flags.
_PLAIN_GPT = ["--untie-embeddings-and-output-weights", "--position-embedding-type", "none"]
OUR_FLAGS = {
    "dp": ["--overlap-grad-reduce"],
    "zero1": ["--zero-stage", "1", "--overlap-grad-reduce", "--overlap-param-gather"],
    "zero2": ["--zero-stage", "2", "--overlap-grad-reduce", "--overlap-param-gather"],
    "zero3": ["--zero-stage", "3"],
    "zero3-prefetch": ["--zero-stage", "3", "--overlap-grad-reduce", "--overlap-param-gather"],
    "tp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"] + _PLAIN_GPT,
    "pp": ["--pipeline-model-parallel-size", "2"] + _PLAIN_GPT,
    # one layer per virtual stage: 2 (default sizes) or 3 (--issue-sizes) chunks per rank
    "pp-interleaved": ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]
    + _PLAIN_GPT,
    "pp-zb-h1": ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1"] + _PLAIN_GPT,
    "pp-zb-v": ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-v"] + _PLAIN_GPT,
    "pp-dualpipev": ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "dualpipev"] + _PLAIN_GPT,
}
MARK = "parallel_overhead.measured_step"
Step = Callable[[], None]


@dataclass
class Sizes:
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    global_batch: int


SMALL = Sizes(layers=4, hidden=64, heads=4, seq=32, vocab=1024, global_batch=8)
ISSUE = Sizes(layers=6, hidden=512, heads=8, seq=256, vocab=50304, global_batch=8)
# A model whose states (params, grads, two Adam moments: 16 bytes a parameter unsharded) dominate the step's
# activations: wide and deep, small vocab, short sequence, micro batch 2 per rank at dp 2. 25.8 M parameters
# (393 MiB of states) against tens of MiB of activations; the size at which issue 16's "ZeRO-3 at most 60%
# of plain dp's peak" is read.
STATES_DOMINATE = Sizes(layers=8, hidden=512, heads=8, seq=64, vocab=1024, global_batch=4)
# A pipeline whose step is its layers' GEMMs, as on a real cluster: at --issue-sizes the output layer (vocab 50304
# x hidden 512, 25.8 M parameters) is 8 transformer layers' worth of GEMM, so the last stage carries most of the
# work and no schedule can fill the first stage's idle time; GPT-3 175B's output layer is 5% of one of its pp 16
# stages (6 layers of hidden 12288). Here: 4 layers a stage (2 per V chunk), vocab 1024 (the output layer 4% of a
# stage), steps of 0.1-0.3 s per micro batch and chunk on one core, so Python per step is under 1% of it.
COMPUTE_DOMINATES = Sizes(layers=8, hidden=512, heads=8, seq=256, vocab=1024, global_batch=8)
ZERO_BUBBLE_MODES = ("pp-zb-h1", "pp-zb-v", "pp-dualpipev")  # also timed against our 1F1B on the same model


def our_config(mode: str, sizes: Sizes, world: int) -> Config:
    """The run's configuration under our flags: one micro batch per data-parallel rank, 8 micro batches of one
    sample under the pipeline modes."""
    dp = world if mode in DATA_PARALLEL_MODES else 1
    micro_batch = 1 if mode.startswith("pp") else sizes.global_batch // dp
    flags = [
        "--num-layers", str(sizes.layers), "--hidden-size", str(sizes.hidden),
        "--num-attention-heads", str(sizes.heads), "--seq-length", str(sizes.seq),
        "--max-position-embeddings", str(sizes.seq), "--micro-batch-size", str(micro_batch),
        "--global-batch-size", str(sizes.global_batch), "--train-iters", "1000", "--lr", "1e-4",
        "--mock-data", "--vocab-size", str(sizes.vocab), "--hidden-dropout", "0", "--attention-dropout", "0",
        "--eval-iters", "0", "--seed", "1234", "--clip-grad", "1.0", "--weight-decay", "0.01",
    ]
    return parse_config(flags + OUR_FLAGS[mode], world_size=world)


def global_batch(config: Config, vocab: int) -> torch.Tensor:
    """The same tokens ``[global batch, s + 1]`` for both sides and every rank."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (config.global_batch_size, config.model.seq_length + 1), generator=generator)


def rank_rows(tokens: torch.Tensor, dp_rank: int, dp_size: int) -> torch.Tensor:
    per_rank = tokens.shape[0] // dp_size
    return tokens[dp_rank * per_rank:(dp_rank + 1) * per_rank]


# ---------------------------------------------------------------- our side


def build_ours(config: Config, tokens: torch.Tensor) -> Step:
    """Our trainer's pieces (``build_model_chunks``, ``parallelize``, ``train_step``) on fixed batches."""
    import pretrain_gpt
    from megatron_like.training.loop import build_model_chunks, train_step
    from megatron_like.training.lr_schedule import LearningRateScheduler
    from megatron_like.training.parallelize import parallelize

    ps = ParallelState.initialize(config.parallel, config.world_size)
    vocab = config.padded_vocab_size(config.model.vocab_size)
    provider = lambda cfg, ps_, **kw: pretrain_gpt.model_provider(cfg, ps_, padded_vocab_size=vocab, **kw)  # noqa: E731
    model = build_model_chunks(config, ps, provider)
    _, optimizer = parallelize(config, ps, model)
    scheduler = LearningRateScheduler(optimizer, config.optimizer, config.training.train_iters)
    rows = rank_rows(tokens, ps.dp_rank, ps.dp_size)
    micro = [{"text": m} for m in rows.split(config.training.micro_batch_size)]
    data: Iterator = itertools.cycle(micro)
    for chunk in model:
        chunk.train()

    def step() -> None:
        train_step(config, ps, pretrain_gpt.forward_step, data, model, optimizer, scheduler)

    return step


# ---------------------------------------------------------------- the PyTorch peers


def _peer_model(config: Config) -> GPTModel:
    """Our GPT of one process (tied head): the module DDP and FSDP2 wrap."""
    vocab = config.padded_vocab_size(config.model.vocab_size)
    return GPTModel(config.model, ParallelState.single_process(), vocab_size=vocab, seed=config.training.seed)


def _adamw(config: Config, model: torch.nn.Module, fused: bool) -> torch.optim.Optimizer:
    o = config.optimizer
    return torch.optim.AdamW(param_groups([model], o.weight_decay), lr=o.lr, betas=(o.adam_beta1, o.adam_beta2),
                             eps=o.adam_eps, fused=fused, foreach=None if fused else True)


def _data_parallel_step(config: Config, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                        rows: torch.Tensor) -> Step:
    """Forward/backward over this rank's micro batches, clip at --clip-grad, AdamW."""
    micro = rows.split(config.training.micro_batch_size)
    positions = torch.arange(config.model.seq_length).unsqueeze(0)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        for text in micro:
            loss = model(text[:, :-1], positions.expand(text.shape[0], -1), labels=text[:, 1:]).mean()
            (loss / len(micro)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.optimizer.clip_grad)
        optimizer.step()

    return step


def build_floor(config: Config, tokens: torch.Tensor) -> Step:
    """No data parallelism at all: each rank trains its own copy of the peer's model on its rows, with no
    communication (the same fused AdamW and clipping). Run on every rank at once between the same barriers, so
    it meets the same contention for the cores; a data-parallel step can be no faster than this (less the
    half of AdamW's work that ZeRO's sharded step saves), so ``peer / floor`` bounds what any implementation
    could gain over the peer."""
    torch.manual_seed(config.training.seed)
    model = _peer_model(config)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    return _data_parallel_step(config, model, _adamw(config, model, fused=True), rank_rows(tokens, rank, world))


def build_ddp(config: Config, tokens: torch.Tensor) -> Step:
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(config.training.seed)
    model = DistributedDataParallel(_peer_model(config))
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    return _data_parallel_step(config, model, _adamw(config, model, fused=True), rank_rows(tokens, rank, world))


def build_zero_redundancy(config: Config, tokens: torch.Tensor) -> Step:
    """ZeRO-1 the PyTorch way: DDP's gradient all-reduce, ``ZeroRedundancyOptimizer`` (each rank steps its
    partition of the params' AdamW states, then broadcasts its updated params)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(config.training.seed)
    model = DistributedDataParallel(_peer_model(config))
    o = config.optimizer
    groups = param_groups([model], o.weight_decay)
    optimizer = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=torch.optim.AdamW, lr=o.lr,
                                        betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
                                        weight_decay=groups[0]["weight_decay"], fused=True)
    for group in groups[1:]:
        optimizer.add_param_group(group)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    return _data_parallel_step(config, model, optimizer, rank_rows(tokens, rank, world))


def build_fsdp2(config: Config, tokens: torch.Tensor, reshard_after_forward: bool = True) -> Step:
    """FSDP2 on every transformer layer and the root; ``reshard_after_forward=False`` keeps the gathered
    params from forward to backward: ZeRO-2 (sharded gradients and optimizer states) in FSDP2's terms."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(config.training.seed)
    model = _peer_model(config)
    for layer in model.layers:
        fully_shard(layer, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    return _data_parallel_step(config, model, _adamw(config, model, fused=False), rank_rows(tokens, rank, world))


class _Attention(nn.Module):
    """Causal self-attention with separate q, k, v projections (so ColwiseParallel splits whole heads)."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [b, s, h]`` -> ``[b, s, h]``; under tensor parallelism the local heads are ``-1``."""
        b, s, _ = x.shape
        q, k, v = (proj(x).view(b, s, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


class _MLP(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class _Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = nn.LayerNorm(hidden), _Attention(hidden, heads), \
            nn.LayerNorm(hidden), _MLP(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class PlainGPT(nn.Module):
    """The tp/pp peers' GPT (pre-LayerNorm, GELU MLP, biases, no position table, untied head), ``[b, s]`` layout.

    ``pre`` / ``post`` keep the embedding / final norm and head, to cut pipeline stages from it.
    """

    def __init__(self, config: Config, vocab: int, layers: range, pre: bool = True, post: bool = True) -> None:
        super().__init__()
        h, heads = config.model.hidden_size, config.model.num_attention_heads
        self.embed = nn.Embedding(vocab, h) if pre else None
        self.layers = nn.ModuleDict({str(i): _Block(h, heads) for i in layers})
        self.norm = nn.LayerNorm(h) if post else None
        self.head = nn.Linear(h, vocab, bias=False) if post else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """tokens ``[b, s]`` (first stage) or hidden ``[b, s, h]`` -> logits ``[b, s, v]`` (last) or hidden."""
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers.values():
            x = layer(x)
        return self.head(self.norm(x)) if self.head is not None else x


def build_dtensor_tp(config: Config, tokens: torch.Tensor) -> Step:
    """torchtitan's plan: vocab-parallel embedding, sequence-parallel norms, col/row-parallel linears,
    a column-parallel head whose vocab-sharded logits feed ``loss_parallel``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        loss_parallel,
        parallelize_module,
    )

    torch.manual_seed(config.training.seed)
    vocab = config.padded_vocab_size(config.model.vocab_size)
    model = PlainGPT(config, vocab, range(config.model.num_layers))
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    parallelize_module(model, mesh, {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })
    for block in model.layers.values():
        parallelize_module(block, mesh, {
            "ln1": SequenceParallel(),
            "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.o": RowwiseParallel(output_layouts=Shard(1)),
            "ln2": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel(output_layouts=Shard(1)),
        })
    optimizer = _adamw(config, model, fused=False)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        logits = model(inputs)
        with loss_parallel():
            F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.optimizer.clip_grad)
        optimizer.step()

    return step


def _build_pipelining(config: Config, tokens: torch.Tensor, schedule_class: str) -> Step:
    """``torch.distributed.pipelining`` stages cut from PlainGPT, run by ``schedule_class`` (a name in
    ``torch.distributed.pipelining``); the grad norm is all-reduced over stages."""
    import torch.distributed.pipelining as pipelining
    from torch.distributed.pipelining import PipelineStage

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    vocab = config.padded_vocab_size(config.model.vocab_size)
    chunks = config.virtual_pipeline_size
    num_stages = world * chunks
    per_stage = config.model.num_layers // num_stages
    stages, modules = [], []
    for chunk in range(chunks):
        # Megatron's and torch's interleaved placement (stage i on rank i % world), or the V's (our zb-v and
        # dualpipev, torch's ScheduleZBVZeroBubble and ScheduleDualPipeV).
        index = virtual_stage(world, rank, chunks, chunk, config.parallel.v_shape)
        torch.manual_seed(config.training.seed + index)
        module = PlainGPT(config, vocab, range(index * per_stage, (index + 1) * per_stage),
                          pre=index == 0, post=index == num_stages - 1)
        modules.append(module)
        stages.append(PipelineStage(module, index, num_stages, torch.device("cpu")))

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())

    microbatches = config.num_microbatches
    schedule_type = getattr(pipelining, schedule_class)
    multi = schedule_class != "Schedule1F1B"  # the multi-stage schedules take a list of stages
    schedule = schedule_type(stages if multi else stages[0], microbatches, loss_fn=loss_fn)
    params = [p for m in modules for p in m.parameters()]
    optimizer = _adamw(config, nn.ModuleList(modules), fused=True)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    first, last = rank == 0, rank == (0 if config.parallel.v_shape else (num_stages - 1) % world)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        kwargs = {"target": labels, "losses": []} if last else {}
        schedule.step(inputs, **kwargs) if first else schedule.step(**kwargs)
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        squared = norm.square()
        torch.distributed.all_reduce(squared)
        torch.nn.utils.clip_grads_with_norm_(params, config.optimizer.clip_grad, squared.sqrt())
        optimizer.step()

    return step


FLOOR = "no data parallelism (floor)"
PEERS: dict[str, tuple[str, Callable[[Config, torch.Tensor], Step]]] = {
    "dp": ("DDP", build_ddp),
    "zero1": ("DDP + ZeroRedundancyOptimizer", build_zero_redundancy),
    "zero2": ("FSDP2 reshard_after_forward=False", lambda c, t: build_fsdp2(c, t, reshard_after_forward=False)),
    "zero3": ("FSDP2 fully_shard", build_fsdp2),
    "zero3-prefetch": ("FSDP2 fully_shard", build_fsdp2),
    "tp": ("DTensor TP+SP, loss_parallel", build_dtensor_tp),
    "pp": ("pipelining Schedule1F1B", lambda c, t: _build_pipelining(c, t, "Schedule1F1B")),
    "pp-interleaved": ("pipelining ScheduleInterleaved1F1B",
                       lambda c, t: _build_pipelining(c, t, "ScheduleInterleaved1F1B")),
    "pp-zb-h1": ("pipelining ScheduleInterleavedZeroBubble",
                 lambda c, t: _build_pipelining(c, t, "ScheduleInterleavedZeroBubble")),
    "pp-zb-v": ("pipelining ScheduleZBVZeroBubble", lambda c, t: _build_pipelining(c, t, "ScheduleZBVZeroBubble")),
    "pp-dualpipev": ("pipelining ScheduleDualPipeV", lambda c, t: _build_pipelining(c, t, "ScheduleDualPipeV")),
}


# ---------------------------------------------------------------- counting the peer's traffic
# Every torch collective reaches the dispatcher as a ``c10d`` op (eager ``torch.distributed`` calls, DDP's
# C++ reducer, FSDP2) or a ``_c10d_functional`` op (DTensor). A dispatch mode sees both; the c10d op a
# functional op runs inside is not seen again (the mode is off while it handles an op), so none counts twice.

# op name -> (kind, index of the argument holding the full tensor(s))
_C10D_OPS = {
    "allreduce_": ("all_reduce", 0), "allreduce_coalesced_": ("all_reduce", 0),
    "_allgather_base_": ("all_gather", 0), "allgather_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1), "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "broadcast_": ("broadcast", 0), "send": ("send", 0),
}
# functional ops take the local input; an all-gather's full tensor is group_size times it
_FUNCTIONAL_OPS = {
    "all_reduce": "all_reduce", "all_reduce_": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "broadcast": "broadcast", "broadcast_": "broadcast",
}


def _nbytes(value: object) -> int:
    """Bytes of a tensor or a (nested) list of tensors."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


class count_peer_traffic(TorchDispatchMode):  # noqa: N801 - used like a function: ``with count_peer_traffic():``
    """Record every collective torch runs while active into ``collectives.count_traffic`` (see above).

    All the peers' groups span the whole world, so the world size is the group size.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - dispatch protocol
        namespace, name = func.namespace, func._overloadpacket.__name__
        world = torch.distributed.get_world_size()
        if namespace == "c10d" and name in _C10D_OPS:
            kind, index = _C10D_OPS[name]
            comm.record_traffic(kind, _nbytes(args[index]), world)
        elif namespace.startswith("_c10d_functional") and name in _FUNCTIONAL_OPS:
            kind = _FUNCTIONAL_OPS[name]
            comm.record_traffic(kind, _nbytes(args[0]) * (world if kind == "all_gather" else 1), world)
        return func(*args, **(kwargs or {}))


# ---------------------------------------------------------------- measuring one side


def profiled_side(build: Callable[[], Step], peer: bool) -> tuple[Step, int, comm.Traffic]:
    """Build a side and run a warm-up and a measured step under the profiler's allocation log.

    Returns ``(step, peak live bytes during the measured step, bytes sent in it)``; the live bytes count
    everything allocated since the build started, so the side's parameters and states are included.
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step = build()
        step()
        peer_counter = count_peer_traffic() if peer else contextlib.nullcontext()
        with comm.count_traffic() as traffic, record_function(MARK), peer_counter:
            step()
    events = list(prof.profiler.kineto_results.events())
    start = min(e.start_ns() for e in events if e.name() == MARK)
    alive = peak = 0
    for event in sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns()):
        alive += event.nbytes()
        if event.start_ns() >= start:
            peak = max(peak, alive)
    return step, peak, traffic


def _usage() -> tuple[float, int]:
    """User + system CPU time and minor page faults of this process so far, every thread (gloo's included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime, usage.ru_minflt


def timed(step: Step) -> tuple[float, float, int]:
    """``(wall seconds, this rank's CPU seconds, its minor page faults)`` of one step, between barriers."""
    comm.barrier()
    begin, (cpu, faults) = time.perf_counter(), _usage()
    step()
    end_cpu, end_faults = _usage()
    comm.barrier()
    return time.perf_counter() - begin, end_cpu - cpu, end_faults - faults


def run_modes(rank: int, world: int, modes: list[str], sizes: Sizes, steps: int) -> dict[str, dict]:
    """On every rank: both sides of each mode in turn; this rank's figures per mode."""
    torch.set_num_threads(1)
    return {mode: run_mode(mode, sizes, steps, world) for mode in modes}


def run_mode(mode: str, sizes: Sizes, steps: int, world: int) -> dict:
    """Both sides of ``mode`` (and, in the data-parallel modes, the floor), measured: timed steps, peak live
    bytes, bytes sent, parameter count."""
    config = our_config(mode, sizes, world)
    tokens = global_batch(config, sizes.vocab)
    builds = {"ours": lambda: build_ours(config, tokens), "peer": lambda: PEERS[mode][1](config, tokens)}
    if mode in DATA_PARALLEL_MODES:
        builds["floor"] = lambda: build_floor(config, tokens)
    if mode in ZERO_BUBBLE_MODES:  # the gain over our 1F1B, timed in the same alternation
        builds["1f1b"] = lambda: build_ours(our_config("pp", sizes, world), tokens)
    stepping, peak, sent = {}, {}, {}
    for side, build in builds.items():
        stepping[side], peak[side], sent[side] = profiled_side(build, peer=side in ("peer", "floor"))
    times: dict[str, list[float]] = {side: [] for side in builds}
    cpu: dict[str, list[float]] = {side: [] for side in builds}
    faults: dict[str, list[int]] = {side: [] for side in builds}
    for _ in range(steps):
        for side, step in stepping.items():
            wall, seconds, minor_faults = timed(step)
            times[side].append(wall)
            cpu[side].append(seconds)
            faults[side].append(minor_faults)
    model = _peer_model(config)
    params = sum(p.numel() for p in model.parameters())
    root_params = params - sum(p.numel() for p in model.layers.parameters())
    return {"times": times, "cpu": cpu, "faults": faults, "peak": peak,
            "sent": {side: t.bytes_sent for side, t in sent.items()},
            "sent_by_kind": {side: t.by_kind for side, t in sent.items()}, "params": params,
            "root_params": root_params}


def theory_bytes(mode: str, sizes: Sizes, params: int, world: int) -> float:
    """Bytes one rank sends per step by the textbook, fp32: dp all-reduces the gradient (2 x params x (w-1)/w);
    ZeRO-1/2 reduce-scatter it and all-gather the updated params (the same 2 x); ZeRO-3 gathers the params a
    second time, for backward (3 x); a pipeline sends ``2v - 1`` activations ``[s, 1, h]`` per micro batch."""
    one_pass = 4 * params * (world - 1) / world
    if mode.startswith("zero3"):
        return 3 * one_pass
    if mode in DATA_PARALLEL_MODES:
        return 2 * one_pass
    if mode in ("pp-zb-v", "pp-dualpipev"):  # on the V each rank sends one activation and one gradient
        return 2 * sizes.global_batch * sizes.seq * sizes.hidden * 4
    if mode.startswith("pp"):
        chunks = sizes.layers // 2 if mode == "pp-interleaved" else 1
        return (2 * chunks - 1) * sizes.global_batch * sizes.seq * sizes.hidden * 4
    return float("nan")  # tp: activations all-gathered and reduce-scattered per layer, not a param multiple


def side_name(mode: str, side: str) -> str:
    """The table's name of a side: ours, the mode's PyTorch peer, or the floor."""
    return {"ours": "megatron_like", "peer": PEERS[mode][0], "floor": FLOOR, "1f1b": "megatron_like 1F1B"}[side]


def table(mode: str, sizes: Sizes, results: list[dict], world: int) -> list[str]:
    """Markdown rows ``| mode | side | s/step | tokens/s | CPU s/step/rank | peak MiB/rank | sent MiB/rank |
    theory | speed (wall) | speed (CPU) |``: ours, the peer, and the floor where it was run."""
    tokens = sizes.global_batch * sizes.seq
    sides = list(results[0]["times"])
    medians = {side: statistics.median(results[0]["times"][side]) for side in sides}
    # per rank the median over the steps, then the busiest rank
    cpu = {side: max(statistics.median(r["cpu"][side]) for r in results) for side in sides}
    rows = []
    for side in sides:
        peak = max(r["peak"][side] for r in results) / 2**20
        sent = max(r["sent"][side] for r in results) / 2**20
        speed, cpu_speed = medians["peer"] / medians[side], cpu["peer"] / cpu[side]
        # the 1F1B side of a zero-bubble mode is the plain pipeline: its own textbook bytes, not the V's
        theory = theory_bytes("pp" if side == "1f1b" else mode, sizes, results[0]["params"], world) / 2**20
        theory_cell = "-" if side == "floor" else f"{theory:.2f}"  # the floor communicates nothing by design
        rows.append(f"| {mode} | {side_name(mode, side)} | {medians[side]:.3f} | {tokens / medians[side]:.0f} | "
                    f"{cpu[side]:.3f} | {peak:.1f} | {sent:.2f} | {theory_cell} | {speed:.2f}x | {cpu_speed:.2f}x |")
    return rows


def gain_over_one_f_one_b(mode: str, results: list[dict]) -> str:
    """A comment line: each side's tokens/s (wall) and CPU seconds per step against our 1F1B on the same model,
    timed in the same alternation (above 1: more tokens/s, less CPU)."""
    wall = {side: statistics.median(results[0]["times"][side]) for side in results[0]["times"]}
    cpu = {side: max(statistics.median(r["cpu"][side]) for r in results) for side in wall}
    return f"# {mode}: vs megatron_like 1F1B on the same model (wall, CPU): " + ", ".join(
        f"{side_name(mode, side)} {wall['1f1b'] / wall[side]:.3f}x {cpu['1f1b'] / cpu[side]:.3f}x"
        for side in ("ours", "peer"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--steps", type=int, default=5, help="timed steps per side")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--issue-sizes", action="store_true",
                        help="GPT 6 layers, hidden 512, 8 heads, seq 256, vocab 50304, global batch 8")
    parser.add_argument("--compute-dominates", action="store_true",
                        help="GPT 8 layers, hidden 512, 8 heads, seq 256, vocab 1024, global batch 8: the layers' "
                        "GEMMs dominate every pipeline stage (the zero-bubble comparison)")
    parser.add_argument("--keep-freed-memory", action="store_true",
                        help="glibc keeps freed memory in every rank (MALLOC_MMAP_THRESHOLD_ 32 MiB, "
                        "MALLOC_TRIM_THRESHOLD_ 1 GiB), as a GPU's caching allocator does: no side pays page "
                        "faults for memory it freed and allocates again")
    parser.add_argument("--hidden", type=int, default=None,
                        help="override the preset's hidden size (e.g. --compute-dominates --hidden 1024: GEMMs with "
                        "twice the arithmetic intensity, so the two ranks sharing this machine's caches and memory bus "
                        "slow each other less)")
    parser.add_argument("--states-dominate", action="store_true",
                        help="GPT 8 layers, hidden 512, 8 heads, seq 64, vocab 1024, global batch 4: parameters, "
                        "gradients and Adam moments dominate the step's activations")
    args = parser.parse_args(argv)
    if args.issue_sizes + args.states_dominate + args.compute_dominates > 1:
        parser.error("--issue-sizes, --states-dominate and --compute-dominates are presets: pass one")
    if args.world_size != 2 and set(args.modes) - set(DATA_PARALLEL_MODES):
        parser.error(f"--world-size {args.world_size}: only {', '.join(DATA_PARALLEL_MODES)} run on other than 2 "
                     "processes (tp and pp are written for 2); pass --modes with those")
    os.environ["OMP_NUM_THREADS"] = "1"
    if args.keep_freed_memory:  # read by glibc when the ranks' fork server starts (tests/distributed/harness.py)
        os.environ.update(MALLOC_MMAP_THRESHOLD_=str(32 << 20), MALLOC_TRIM_THRESHOLD_=str(1 << 30))
    from tests.distributed.harness import run_distributed

    sizes = (ISSUE if args.issue_sizes else STATES_DOMINATE if args.states_dominate
             else COMPUTE_DOMINATES if args.compute_dominates else SMALL)
    if args.hidden is not None:
        if args.hidden % sizes.heads:
            parser.error(f"--hidden {args.hidden}: must be a multiple of the preset's {sizes.heads} heads")
        sizes = dataclasses.replace(sizes, hidden=args.hidden)
    for mode in args.modes:  # a mode these sizes cannot run fails here, not after the modes before it
        try:
            our_config(mode, sizes, args.world_size)
        except ConfigError as error:
            parser.error(f"--modes {mode} at {sizes}: {error}")
    print(f"# {sizes}, fp32, {args.world_size} processes x 1 thread, {args.steps} timed steps per side, "
          f"load average {os.getloadavg()[0]:.1f}" + (", freed memory kept (glibc)" if args.keep_freed_memory else ""))
    print("| mode | implementation | s/step (median) | tokens/s | CPU s/step/rank | peak MiB/rank | sent MiB/rank "
          "| theory MiB/rank | speed vs peer (wall) | (CPU) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    results = run_distributed(run_modes, args.world_size, args.modes, sizes, args.steps, timeout=3600)
    for mode in args.modes:
        for row in table(mode, sizes, [r[mode] for r in results], args.world_size):
            print(row)
    print(f"# parameters of the model: {results[0][args.modes[0]]['params']}")
    for mode in args.modes:  # fresh pages touched per step (a new large buffer faults in each of its pages)
        sides = list(results[0][mode]["faults"])
        faults = {side: max(statistics.median(r[mode]["faults"][side]) for r in results) for side in sides}
        print(f"# {mode}: minor page faults per step (median, busiest rank): "
              + ", ".join(f"{side_name(mode, side)} {faults[side]:.0f}" for side in sides))
    for mode in [m for m in args.modes if m in ZERO_BUBBLE_MODES]:
        print(gain_over_one_f_one_b(mode, [r[mode] for r in results]))
    print(f"# load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
