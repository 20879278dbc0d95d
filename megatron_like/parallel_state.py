"""The one object that owns the process groups and the device.

Rank layout (docs/design.md §3), Megatron's order tp-cp-dp-pp: tensor-parallel innermost, then
context-parallel, then data-parallel, then pipeline outermost::

    rank = pp_rank * (dp * cp * tp) + dp_rank * (cp * tp) + cp_rank * tp + tp_rank

With cp = 1 (no context parallelism) that is ``pp_rank * (dp * tp) + dp_rank * tp + tp_rank``. The cp ranks of
one data-parallel rank read the same batch and each keeps two of its 2 x cp sequence chunks
(docs/context_parallel.md); gradients are reduced and ZeRO shards over the dp x cp ranks (``dp_cp_group``,
Megatron's ``with_context_parallel=True``): they hold the same parameters.

The experts of an MoE layer see the same ``tp * cp * dp`` ranks of a pipeline stage another way (Megatron-core's
expert rank generator, order tp-ep-dp; docs/moe.md): expert tensor parallelism innermost, then expert
parallelism, then expert data parallelism::

    rank = pp_rank * (dp * cp * tp) + expert_dp_rank * (ep * etp) + ep_rank * etp + etp_rank

``etp`` ranks split each expert's matmuls, ``ep_rank`` picks the experts a rank holds, ``expert_dp_rank``
numbers the ranks holding the same expert shards (the expert-data-parallel group, over which expert
gradients are reduced and ZeRO shards them). With ``etp = tp`` (the default) the expert tp group is the tp
group and the ep groups are ``ep`` consecutive data-parallel ranks; with ``etp != tp`` the two layouts
differ, e.g. tp 2 with etp 1 and ep 2 makes the two tp ranks two expert-parallel ranks.

Every other module gets its groups and its device from a :class:`ParallelState` that is passed in;
nothing else in the codebase calls ``torch.distributed.new_group`` or picks a device.
A ``ParallelState.single_process()`` needs no process group at all: it is what the equivalence tests
and the single-process reference runs use.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_like.config import ConfigError, ParallelConfig
from megatron_like.launcher_guard import die_with_launcher


def pick_device_and_backend(requested_backend: str | None = None) -> tuple[torch.device, str]:
    """CUDA + NCCL when a GPU is present, else CPU + gloo. The only place that decides the device."""
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        return device, requested_backend or "nccl"
    if requested_backend == "nccl":
        raise ConfigError("--distributed-backend nccl needs a GPU; none is visible (use gloo or drop the flag)")
    return torch.device("cpu"), "gloo"


def _restart_safe_store(timeout: datetime.timedelta) -> dict:
    """``store``, ``rank`` and ``world_size`` for ``init_process_group`` under ``torchrun --max-restarts``.

    Restarted workers reach the same agent store as the attempt that failed; on torch 2.13 gloo then
    finds the dead ranks' addresses and the restart hangs. Keys prefixed by the restart count keep each
    attempt apart. Outside torchelastic (no TORCHELASTIC_RESTART_COUNT) torch's env:// default is used.
    """
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None or "MASTER_ADDR" not in os.environ:
        return {}
    # The torchrun agent hosts the store unless it says otherwise; then rank 0 does (as torch's env://).
    hosted_by_agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout=timeout,
                          is_master=not hosted_by_agent and os.environ["RANK"] == "0")
    return {"store": dist.PrefixStore(f"megatron_like/restart_{restart}", store),
            "rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])}


@dataclass
class ParallelState:
    """Sizes, this process's coordinates and the process groups of one run.

    A group is ``None`` when its size is 1: collectives on it are skipped (see collectives.py).
    """

    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None
    tp_group: dist.ProcessGroup | None = None
    pp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    model_parallel_group: dist.ProcessGroup | None = None
    """tp x pp ranks that hold one full model replica (for the global grad norm)."""
    embedding_group: dist.ProcessGroup | None = None
    """First and last pipeline stage of one (dp, tp) position: they share the word embedding (None when one
    rank holds both, as in the V placement)."""
    pp_v_shape: bool = False
    """Model chunks placed in a V (--pipeline-schedule zb-v or dualpipev): the first and the last virtual stage
    are both on pipeline rank 0 (pipeline_parallel/placement.py)."""
    keep_gathered_sequence_for_wgrad: bool = False
    """--keep-gathered-sequence-for-wgrad: a zero-bubble schedule's W steps keep the all-gathered sequence, not
    the shards (tensor_parallel/sequence_parallel_linear.py)."""
    ep_size: int = 1
    """Expert-parallel size (``etp * ep`` divides ``tp * dp``)."""
    etp_size: int | None = None
    """Expert tensor-parallel size; None: ``tp_size`` (Megatron's default)."""
    ep_group: dist.ProcessGroup | None = None
    """The ``ep`` ranks that split the experts (same expert tp rank, same expert-dp rank)."""
    etp_group: dist.ProcessGroup | None = None
    """The ``etp`` consecutive ranks that split each expert's matmuls (the tp group when etp = tp)."""
    expert_tp_ep_group: dist.ProcessGroup | None = None
    """The ``etp * ep`` consecutive ranks that together hold one copy of every expert."""
    expert_dp_group: dist.ProcessGroup | None = None
    """Ranks holding the same expert shards (``tp dp / (etp ep)`` of them): expert gradients reduce here."""
    cp_size: int = 1
    """Context-parallel size: ranks that split each sequence (docs/context_parallel.md)."""
    cp_comm_type: str = "p2p"
    """How attention crosses the cp ranks: p2p, all_gather, a2a or a2a+p2p (--cp-comm-type)."""
    cp_group: dist.ProcessGroup | None = None
    """The ``cp`` consecutive (in units of tp) ranks that hold the chunks of one sequence."""
    cp_a2a_group: dist.ProcessGroup | None = None
    """a2a+p2p: the inner all-to-all group (consecutive cp ranks, --hierarchical-context-parallel-sizes' first)."""
    cp_ring_group: dist.ProcessGroup | None = None
    """a2a+p2p: the cp ranks with the same position in their all-to-all group, joined by the ring."""
    dp_cp_group: dist.ProcessGroup | None = None
    """dp x cp ranks holding the same parameters: gradients are averaged and ZeRO shards over them."""
    cp_global_ranks: list[int] = field(default_factory=lambda: [0])
    """Global ranks of this process's cp group, by cp rank (the ring's neighbours)."""
    cp_ring_global_ranks: list[int] = field(default_factory=lambda: [0])
    """Global ranks of this process's a2a+p2p ring group, in ring order."""
    pp_global_ranks: list[int] = field(default_factory=lambda: [0])
    """Global ranks of this process's pipeline group, by stage (for send/recv)."""
    dp_global_ranks: list[int] = field(default_factory=lambda: [0])
    tp_global_ranks: list[int] = field(default_factory=lambda: [0])

    # ---------------------------------------------------------------- coordinates
    @property
    def world_size(self) -> int:
        return self.tp_size * self.cp_size * self.pp_size * self.dp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def cp_rank(self) -> int:
        return (self.rank // self.tp_size) % self.cp_size

    @property
    def dp_rank(self) -> int:
        return (self.rank // (self.tp_size * self.cp_size)) % self.dp_size

    @property
    def dp_cp_size(self) -> int:
        """Ranks holding the same parameters (the data-parallel group with context parallelism, dp x cp)."""
        return self.dp_size * self.cp_size

    @property
    def dp_cp_rank(self) -> int:
        """This rank's place among the dp x cp ranks (``dp_rank * cp + cp_rank``): its ZeRO shard."""
        return self.dp_rank * self.cp_size + self.cp_rank

    @property
    def expert_tp_size(self) -> int:
        return self.tp_size if self.etp_size is None else self.etp_size

    @property
    def _stage_rank(self) -> int:
        """Position inside this pipeline stage's ``tp * cp * dp`` ranks."""
        return self.rank % (self.tp_size * self.cp_size * self.dp_size)

    @property
    def etp_rank(self) -> int:
        return self._stage_rank % self.expert_tp_size

    @property
    def ep_rank(self) -> int:
        return self._stage_rank // self.expert_tp_size % self.ep_size

    @property
    def expert_dp_size(self) -> int:
        return self.tp_size * self.cp_size * self.dp_size // (self.expert_tp_size * self.ep_size)

    @property
    def expert_dp_rank(self) -> int:
        return self._stage_rank // (self.expert_tp_size * self.ep_size)

    @property
    def experts_split_like_tp(self) -> bool:
        """etp = tp: the expert tp group is the tp group, whose ranks hold the same tokens (docs/moe.md)."""
        return self.expert_tp_size == self.tp_size

    def expert_rank_of(self, etp_rank: int, ep_rank: int, expert_dp_rank: int, pp_rank: int) -> int:
        """Global rank of the process at these expert coordinates (Megatron's expert order tp-ep-dp-pp)."""
        etp, ep = self.expert_tp_size, self.ep_size
        return pp_rank * (self.dp_size * self.cp_size * self.tp_size) + (expert_dp_rank * ep + ep_rank) * etp + etp_rank

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.tp_size * self.cp_size * self.dp_size)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def reporting_rank(self) -> int:
        """The global rank that prints the log: the last of the ranks that compute the loss (the last pipeline
        stage's, which is stage 0 in the V placement)."""
        return (self.world_size // self.pp_size if self.pp_v_shape else self.world_size) - 1

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def rank_of(self, tp_rank: int, dp_rank: int, pp_rank: int, cp_rank: int = 0) -> int:
        """Global rank of the process at these coordinates."""
        tp, cp = self.tp_size, self.cp_size
        return ((pp_rank * self.dp_size + dp_rank) * cp + cp_rank) * tp + tp_rank

    def pp_neighbor(self, offset: int) -> int:
        """Global rank of the stage ``offset`` away in this pipeline (wrapping around)."""
        return self.pp_global_ranks[(self.pp_rank + offset) % self.pp_size]

    def describe(self) -> str:
        experts = f", ep {self.ep_rank}/{self.ep_size}" if self.ep_size > 1 else ""
        if not self.experts_split_like_tp:
            experts += f", expert tp {self.etp_rank}/{self.expert_tp_size}"
        return (
            f"rank {self.rank}: tp {self.tp_rank}/{self.tp_size}, "
            + (f"cp {self.cp_rank}/{self.cp_size} ({self.cp_comm_type}), " if self.cp_size > 1 else "")
            + f"dp {self.dp_rank}/{self.dp_size}{experts}, "
            f"pp {self.pp_rank}/{self.pp_size} on {self.device} ({self.backend or 'no backend'})"
        )

    # ---------------------------------------------------------------- construction
    @classmethod
    def single_process(cls, device: torch.device | None = None) -> ParallelState:
        """A 1x1x1 layout with no process groups: the reference every parallel run is compared with."""
        if device is None:
            device, _ = pick_device_and_backend()
        return cls(device=device)

    @classmethod
    def initialize(cls, parallel: ParallelConfig, world_size: int | None = None) -> ParallelState:
        """Start the default process group (from torchrun's env vars) and build every subgroup.

        With one process and no launcher environment, no process group is started at all.
        """
        device, backend = pick_device_and_backend(parallel.distributed_backend)
        if world_size is None:
            world_size = int(os.environ.get("WORLD_SIZE", "1"))
        tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
        cp = parallel.context_parallel_size
        if world_size % (tp * cp * pp) != 0:
            raise ConfigError(
                f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} * "
                + (f"--context-parallel-size {cp} * " if cp > 1 else "") + f"--pipeline-model-parallel-size {pp}"
            )
        if not dist.is_initialized():
            die_with_launcher()  # a worker must not outlive torchrun (no orphans writing checkpoints), even alone
        if world_size == 1 and not dist.is_initialized():
            return cls.single_process(device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            timeout = datetime.timedelta(minutes=parallel.distributed_timeout_minutes)
            # With NCCL, device_id binds the process to its GPU and forms NCCL's world communicator now, with
            # every rank: the pipeline's first batch_isend_irecv (between neighbours only) must not be the
            # world group's first operation (torch documents that case as undefined with NCCL).
            device_id = device if backend == "nccl" else None
            dist.init_process_group(backend=backend, timeout=timeout, device_id=device_id,
                                    **_restart_safe_store(timeout))
        dp, ep = world_size // (tp * cp * pp), parallel.expert_model_parallel_size
        etp = tp if parallel.expert_tensor_parallel_size is None else parallel.expert_tensor_parallel_size
        if (tp * cp * dp) % (etp * ep) != 0:
            raise ConfigError(f"--expert-tensor-parallel-size {etp} * --expert-model-parallel-size {ep} does not "
                              f"divide tp {tp} * cp {cp} * dp {dp} (the ranks of one pipeline stage)")
        state = cls(tp_size=tp, pp_size=pp, dp_size=dp, cp_size=cp, cp_comm_type=parallel.cp_comm_type,
                    ep_size=ep, etp_size=etp, rank=dist.get_rank(), pp_v_shape=parallel.v_shape,
                    keep_gathered_sequence_for_wgrad=parallel.keep_gathered_sequence_for_wgrad)
        state.device, state.backend = device, backend
        state._build_groups()
        if cp > 1 and parallel.cp_comm_type == "a2a+p2p":
            state._build_hierarchical_cp_groups(parallel.hierarchical_context_parallel_sizes[0])
        return state

    def _build_groups(self) -> None:
        """Create every subgroup. All ranks create all groups in the same order (a torch requirement)."""
        tp, pp, dp, cp = self.tp_size, self.pp_size, self.dp_size, self.cp_size
        me = self.rank

        def make(ranks: list[int]) -> dist.ProcessGroup | None:
            group = dist.new_group(ranks)
            return group if me in ranks else None

        for p in range(pp):
            for d in range(dp):
                for c in range(cp):
                    ranks = [self.rank_of(t, d, p, c) for t in range(tp)]
                    group = make(ranks)
                    if me in ranks:
                        self.tp_group, self.tp_global_ranks = group, ranks
        for p in range(pp):
            for c in range(cp):
                for t in range(tp):
                    ranks = [self.rank_of(t, d, p, c) for d in range(dp)]
                    group = make(ranks)
                    if me in ranks:
                        self.dp_group, self.dp_global_ranks = group, ranks
        self.dp_cp_group = self.dp_group  # cp = 1: the ranks holding the same parameters are the dp ranks
        if cp > 1:  # the sequence's cp ranks, and the dp x cp ranks that hold the same parameters
            for p in range(pp):
                for d in range(dp):
                    for t in range(tp):
                        ranks = [self.rank_of(t, d, p, c) for c in range(cp)]
                        group = make(ranks)
                        if me in ranks:
                            self.cp_group, self.cp_global_ranks = group, ranks
            for p in range(pp):
                for t in range(tp):
                    ranks = [self.rank_of(t, d, p, c) for d in range(dp) for c in range(cp)]
                    group = make(ranks)
                    if me in ranks:
                        self.dp_cp_group = group
        for d in range(dp):
            for c in range(cp):
                for t in range(tp):
                    ranks = [self.rank_of(t, d, p, c) for p in range(pp)]
                    group = make(ranks)
                    if me in ranks:
                        self.pp_group, self.pp_global_ranks = group, ranks
                    embedding_ranks = [ranks[0]] if self.pp_v_shape else sorted({ranks[0], ranks[-1]})
                    group = make(embedding_ranks)
                    if me in embedding_ranks and len(embedding_ranks) > 1:
                        self.embedding_group = group
        for d in range(dp):
            for c in range(cp):
                ranks = [self.rank_of(t, d, p, c) for p in range(pp) for t in range(tp)]
                group = make(ranks)
                if me in ranks:
                    self.model_parallel_group = group
        ep, etp, edp = self.ep_size, self.expert_tp_size, self.expert_dp_size
        if ep > 1 or etp != tp:  # the expert layout of each stage (Megatron's expert rank generator)
            for p in range(pp):
                for d in range(edp):
                    for e in range(ep):
                        ranks = [self.expert_rank_of(t, e, d, p) for t in range(etp)]
                        group = make(ranks) if etp != tp else self.tp_group  # etp = tp: these are the tp groups
                        if me in ranks:
                            self.etp_group = group
                    for t in range(etp):
                        ranks = [self.expert_rank_of(t, e, d, p) for e in range(ep)]
                        group = make(ranks)
                        if me in ranks:
                            self.ep_group = group
                    ranks = [self.expert_rank_of(t, e, d, p) for e in range(ep) for t in range(etp)]
                    group = make(ranks)
                    if me in ranks:
                        self.expert_tp_ep_group = group
                for e in range(ep):
                    for t in range(etp):
                        ranks = [self.expert_rank_of(t, e, d, p) for d in range(edp)]
                        group = make(ranks)
                        if me in ranks:
                            self.expert_dp_group = group
        else:  # no expert layout of its own: experts split and reduce like the dense MLP
            self.etp_group, self.expert_tp_ep_group = self.tp_group, self.tp_group
            self.expert_dp_group = self.dp_cp_group
        # Groups of size one never need a collective; None makes that explicit to every caller.
        if tp == 1:
            self.tp_group = None
        if dp * cp == 1:
            self.dp_cp_group = None
        if dp == 1:
            self.dp_group = None
        if ep == 1:
            self.ep_group = None
        if etp == 1:
            self.etp_group = None
        if etp * ep == 1:
            self.expert_tp_ep_group = None
        if edp == 1:
            self.expert_dp_group = None
        if pp == 1:
            self.pp_group = None
        if tp * pp == 1:
            self.model_parallel_group = None

    def _build_hierarchical_cp_groups(self, a2a_size: int) -> None:
        """a2a+p2p: split every cp group into all-to-all groups of ``a2a_size`` consecutive cp ranks and the rings
        that join the ranks at the same place of each (Megatron's hierarchical context parallelism)."""
        rings = self.cp_size // a2a_size
        me = self.rank
        for p in range(self.pp_size):
            for d in range(self.dp_size):
                for t in range(self.tp_size):
                    cp_ranks = [self.rank_of(t, d, p, c) for c in range(self.cp_size)]
                    for outer in range(rings):
                        ranks = cp_ranks[outer * a2a_size:(outer + 1) * a2a_size]
                        group = dist.new_group(ranks)
                        if me in ranks:
                            self.cp_a2a_group = group if a2a_size > 1 else None
                    for inner in range(a2a_size):
                        ranks = cp_ranks[inner::a2a_size]
                        group = dist.new_group(ranks)
                        if me in ranks:
                            self.cp_ring_group, self.cp_ring_global_ranks = (group if rings > 1 else None), ranks

    def use_device_in_this_thread(self) -> None:
        """Make this rank's GPU the current one in the calling thread (a new thread starts on GPU 0, so a
        thread that runs the model, e.g. an HTTP handler, must call this); nothing to do on CPU."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
