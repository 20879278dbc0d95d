"""Code paths that only CUDA + NCCL take, checked on CPU.

* NCCL reduces, broadcasts and sends only device tensors. A tensor built with ``torch.tensor(...)``
  (or ``zeros``, ``empty``...) without ``device=`` lives on the CPU, which gloo accepts and NCCL rejects.
  ``test_no_host_tensor_reaches_a_collective`` reads the source: inside one function, no such tensor
  (directly, or through a name it was assigned to) may be an argument of a ``collectives`` call.
* ``--optimizer-cpu-offload`` on a GPU keeps host copies of the device gradient shards (on CPU the
  optimizer uses the shards themselves). ``test_offload_host_gradient_copies`` runs that copy path on CPU.
* A checkpoint's tensor-parallel RNG states are generator states of the device type that saved them;
  resuming on the other type keeps fresh streams with a warning.
"""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch
from torch import nn

from megatron_like.config import OptimizerConfig, PrecisionConfig
from megatron_like.distributed import DataParallel
from megatron_like.optimizer import DistributedOptimizer
from megatron_like.optimizer import distributed_optimizer as optimizer_module
from megatron_like.parallel_state import ParallelState

ROOT = pathlib.Path(__file__).resolve().parents[2]
FACTORIES = {"tensor", "as_tensor", "frombuffer", "zeros", "ones", "empty", "full", "arange", "rand", "randn",
             "randint"}
"""torch functions that create a tensor on the CPU unless given ``device=``."""
COMMUNICATING = {"all_reduce", "all_gather_along_dim", "reduce_scatter_along_dim", "broadcast", "post_p2p",
                 "exchange", "all_reduce_flat", "reduce_scatter_flat", "all_gather_flat"}
"""The functions of megatron_like/collectives.py that hand their tensors to the backend."""


def _is_host_factory(node: ast.AST) -> bool:
    """``torch.<factory>(...)`` without ``device=``."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in FACTORIES
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
            and not any(k.arg == "device" for k in node.keywords))


def _is_host_tensor(node: ast.AST, host_names: set[str]) -> bool:
    """A host factory call or a name bound to one, possibly followed by method calls other than ``.to``."""
    while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and not _is_host_factory(node):
        if node.func.attr in ("to", "cuda"):
            return False
        node = node.func.value
    return _is_host_factory(node) or (isinstance(node, ast.Name) and node.id in host_names)


def _tensors_in(node: ast.AST) -> list[ast.AST]:
    """``node``, or the elements of a list/tuple argument (``exchange`` takes ``[(tensor, peer)]``)."""
    if isinstance(node, (ast.List, ast.Tuple)):
        return [t for element in node.elts for t in _tensors_in(element)]
    return [node]


def host_tensors_passed_to_collectives(source: str, filename: str) -> list[str]:
    """``file:line`` of each collectives call (``comm.<fn>``) that receives a host tensor."""
    found = []
    functions = [n for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for function in functions:
        host_names: set[str] = set()
        for node in ast.walk(function):  # a name bound to a host tensor anywhere in the function counts
            if isinstance(node, ast.Assign) and _is_host_tensor(node.value, host_names):
                host_names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        for node in ast.walk(function):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "comm"
                    and node.func.attr in COMMUNICATING
                    and any(_is_host_tensor(t, host_names) for arg in node.args for t in _tensors_in(arg))):
                found.append(f"{filename}:{node.lineno}")
    return sorted(set(found))


def source_files() -> list[pathlib.Path]:
    files = [p for folder in ("megatron_like", "tools", "tasks") for p in (ROOT / folder).rglob("*.py")]
    return sorted(files + list(ROOT.glob("*.py")))


def test_the_checker_finds_host_tensors():
    bad = """
def f(ps, values):
    seed = torch.tensor([1], dtype=torch.long)
    comm.broadcast(seed, 0, ps.tp_group)
    comm.broadcast(torch.empty(3), 0, ps.tp_group)
    t = torch.zeros(2)
    comm.all_reduce(t.float(), ps.dp_group)
    comm.exchange([], [(torch.empty(2, 3), 1)])
    shard = comm.split_along_dim(torch.empty(4), ps.tp_group, dim=0)  # no communication
"""
    good = """
def f(ps):
    seed = torch.tensor([1], dtype=torch.long, device=ps.device)
    comm.broadcast(seed, 0, ps.tp_group)
    flag = torch.tensor(True).float().to(ps.device)
    comm.all_reduce(flag, ps.dp_group)
"""
    assert host_tensors_passed_to_collectives(bad, "bad.py") == ["bad.py:4", "bad.py:5", "bad.py:7", "bad.py:8"]
    assert host_tensors_passed_to_collectives(good, "good.py") == []


def test_no_host_tensor_reaches_a_collective():
    found = []
    for path in source_files():
        text = path.read_text()
        if "collectives" in text:
            found += host_tensors_passed_to_collectives(text, str(path.relative_to(ROOT)))
    assert not found, f"CPU tensors given to a collective (NCCL rejects them; create them on ps.device): {found}"


def _train(steps: int, clip_grad: float) -> tuple[list[float], list[torch.Tensor]]:
    ps = ParallelState.single_process(torch.device("cpu"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    data_parallel = DataParallel([model], ps)
    optimizer = DistributedOptimizer(data_parallel, OptimizerConfig(lr=1e-2, clip_grad=clip_grad),
                                     PrecisionConfig(), ps, cpu_offload=True)
    x, y = torch.randn(32, 8, generator=torch.Generator().manual_seed(1)), torch.randn(32, 4)
    norms = []
    for _ in range(steps):
        data_parallel.start_grad_sync(1)
        nn.functional.mse_loss(model(x), y).mul(100.0).backward()
        data_parallel.finish_grad_sync()
        norms.append(optimizer.step().grad_norm)
    return norms, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("clip_grad", [0.0, 0.5])
def test_offload_host_gradient_copies(monkeypatch, clip_grad):
    """The GPU offload layout (gradients copied to host masters) trains exactly as the CPU one."""
    norms, params = _train(3, clip_grad)
    monkeypatch.setattr(optimizer_module, "_needs_host_copy", lambda grad_shard, master_device: True)
    copied_norms, copied_params = _train(3, clip_grad)
    assert copied_norms == pytest.approx(norms, rel=1e-6)
    if clip_grad:
        assert max(norms) > clip_grad  # clipping was active
    for ours, reference in zip(copied_params, params):
        torch.testing.assert_close(ours, reference, rtol=1e-6, atol=1e-7)


def test_rng_states_saved_on_another_device_type_keep_the_fresh_streams():
    """A CPU generator state cannot seed CUDA's generator (nor the reverse): resuming a checkpoint on the
    other device type keeps the run's freshly seeded tensor-parallel streams and says so."""
    from megatron_like.tensor_parallel.random import MODEL_PARALLEL_RNG, get_rng_tracker
    from megatron_like.training.checkpointing import rng_state, set_rng_state

    tracker = get_rng_tracker()
    before = (tracker.device_type, tracker.get_states())
    try:
        tracker.reset("cpu")
        tracker.add(MODEL_PARALLEL_RNG, 7)
        fresh = tracker.get_states()[MODEL_PARALLEL_RNG]
        saved = rng_state()
        other = torch.Generator().manual_seed(8).get_state()
        with pytest.warns(UserWarning, match="saved on cuda, this run is on cpu"):
            set_rng_state({**saved, "tracker_device": "cuda", "tracker": {MODEL_PARALLEL_RNG: other[:16]}})
        assert torch.equal(tracker.get_states()[MODEL_PARALLEL_RNG], fresh)
        set_rng_state({**saved, "tracker": {MODEL_PARALLEL_RNG: other}})  # same device type: restored
        assert torch.equal(tracker.get_states()[MODEL_PARALLEL_RNG], other)
    finally:
        tracker.reset(before[0])
        tracker.set_states(before[1])
