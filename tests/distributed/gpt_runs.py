"""Shared pieces of the equivalence tests: a training run through ``pretrain()`` and the full weights.

``train_gpt(rank, world_size, flags)`` runs the real trainer on mock data with the given CLI flags and
returns what this rank knows: the logged losses (last stage) and its parameters under *global* names,
with tensor-parallel shards gathered to full tensors (and, in bf16/fp16, the fp32 master weights of the
parameters replicated over tp). ``merge_ranks`` assembles the full model from the per-rank results so it can be
compared with the single-process run.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from megatron_like import collectives as comm
from megatron_like.config import parse_config
from megatron_like.parallel_state import ParallelState

TRAIN_ITERS = 2
"""Training steps of every run of BASE_FLAGS. The second step starts from updated weights and carries optimizer
state (Adam's moments and step count, the lr schedule) and the logged loss of the updated model; a third runs the
same code again. Each step is most of a multi-process run's time (its ranks wait in gloo collectives)."""

BASE_FLAGS = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
    "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--train-iters", str(TRAIN_ITERS), "--lr", "1e-3", "--mock-data", "--vocab-size", "256", "--hidden-dropout", "0",
    "--attention-dropout", "0", "--log-interval", "1", "--seed", "1234", "--num-workers", "0",
    "--make-vocab-size-divisible-by", "8", "--eval-iters", "0",
    # Adam divides by sqrt(v) + eps: with the default 1e-8 a gradient of 1e-9 (rounding noise on a
    # parameter whose exact gradient is ~0) becomes a full lr-sized step whose sign depends on the
    # reduction order. eps 1e-5 keeps such noise from dominating while real gradients (>1e-4) are unaffected.
    "--adam-eps", "1e-5",
    # The CPU log's memory figure runs the profiler through the first logged steps: ~40% of a tiny run's CPU on
    # the reporting rank. These tests compare training; the figure is tested in test_plan.py, and the CLI tests
    # (tests/e2e) train with it on under every layout.
    "--no-log-memory",
]


def global_name(chunk: torch.nn.Module, local_name: str) -> str:
    """``layers.0.mlp.fc1.weight`` of a chunk holding layer 5 -> ``layers.5.mlp.fc1.weight``."""
    if local_name.startswith("layers."):
        _, index, rest = local_name.split(".", 2)
        return f"layers.{chunk.layers[int(index)].layer}.{rest}"
    return local_name


def full_parameters(model: list[torch.nn.Module], ps: ParallelState) -> dict[str, torch.Tensor]:
    """This rank's parameters under global names, tensor-parallel shards gathered along their split dim."""
    from megatron_like.distributed import gathered_parameters

    out = {}
    with gathered_parameters(model):  # ZeRO-3 params hold no memory between uses
        _collect_parameters(model, ps, out)
    return out


def _collect_parameters(model: list[torch.nn.Module], ps: ParallelState, out: dict[str, torch.Tensor]) -> None:
    for chunk in model:
        for name, param in chunk.named_parameters():
            if getattr(param, "shared_embedding", False):
                continue  # the last stage's copy of the tied embedding; the first stage reports it
            tensor = param.detach()
            expert = getattr(param, "expert_parallel", False)  # MoE: split over expert tp, experts over ep
            if getattr(param, "tensor_model_parallel", False):
                tp_group = ps.etp_group if expert else ps.tp_group
                tensor = comm.all_gather_along_dim(tensor, tp_group, dim=param.partition_dim)
            if expert:  # [E / ep, ...] -> every expert, in order
                tensor = comm.all_gather_along_dim(tensor, ps.ep_group, dim=0)
            # float32: bf16 has no numpy dtype to cross the process boundary in (and compares the same).
            out[global_name(chunk, name)] = tensor.to(torch.float32, copy=True)


def train_gpt(rank: int, world_size: int, flags: list[str], forward_step: Callable | None = None,
              on_chunk: Callable[[torch.nn.Module, ParallelState], None] | None = None) -> dict:
    """Run pretrain() with ``BASE_FLAGS + flags``; return this rank's losses and full parameters.

    ``forward_step`` replaces ``pretrain_gpt.forward_step`` (e.g. to inject a fault); ``on_chunk(chunk, ps)``
    runs on each model chunk as soon as it is built (e.g. to attach hooks).
    """
    import pretrain_gpt
    from megatron_like.training import pretrain

    config = parse_config(BASE_FLAGS + flags, world_size=world_size)
    ps = ParallelState.initialize(config.parallel, world_size)
    vocab = config.padded_vocab_size(config.model.vocab_size)
    provider = functools.partial(pretrain_gpt.model_provider, padded_vocab_size=vocab)
    if on_chunk is not None:
        provider = _with_chunk_hook(provider, on_chunk)
    result = pretrain(config, provider, forward_step or pretrain_gpt.forward_step, pretrain_gpt.datasets_provider,
                      ps=ps, padded_vocab_size=vocab)
    return {
        "losses": result.losses,
        "grad_norms": result.grad_norms,
        "params": full_parameters(result.model, ps),
        "masters": replicated_masters(result.optimizer, result.model),
        "coords": (ps.tp_rank, ps.dp_rank, ps.pp_rank),
        "loss_scales": result.loss_scales,
        "skipped_iterations": result.skipped_iterations,
        "nan_iterations": result.nan_iterations,
        "bad_iterations": result.bad_iterations,
        "moe_losses": result.moe_losses,
        "expert_biases": result.expert_biases,
        "loss_stats": result.loss_stats,
    }


def replicated_masters(optimizer, model: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """``{global name: fp32 master weight}`` of this rank's parameters replicated over tp (norms, the biases of
    row-parallel linears) whose master it holds whole, when masters are separate from the params (bf16/fp16).

    A bf16 norm weight near 1 (spacing 2^-7) hides the lr-sized steps by which tp ranks' copies drift apart when
    the sequence-parallel gradient all-reduce is missing; its fp32 master shows them."""
    names = {param: global_name(chunk, name) for chunk in model for name, param in chunk.named_parameters()}
    masters = {}
    for bucket, master, alias in zip(optimizer.buckets, optimizer.masters, optimizer.master_is_param):
        if alias:
            continue
        for param, lo, hi, param_lo, param_hi in bucket.shard_segments():
            split = any(getattr(param, attr, False)
                        for attr in ("tensor_model_parallel", "expert_parallel", "shared_embedding"))
            if not split and param_lo == 0 and param_hi == param.numel():
                masters[names[param]] = master[lo:hi].view(param.shape).clone()
    return masters


def _with_chunk_hook(provider: Callable, on_chunk: Callable) -> Callable:
    def build(config, ps: ParallelState, **kwargs) -> torch.nn.Module:
        chunk = provider(config, ps, **kwargs)
        on_chunk(chunk, ps)
        return chunk

    return build


def train_gpt_many(rank: int, world_size: int, flag_lists: list[list[str]]) -> list[dict]:
    """``train_gpt`` for each flag list in turn, in one process group (spawning costs more than a run)."""
    return [train_gpt(rank, world_size, flags) for flags in flag_lists]


def merge_ranks(results: list[dict]) -> dict:
    """Losses from the ranks that have them (all equal) and the union of parameters over stages.

    Every rank holding a parameter (its data-parallel replicas, and tensor-parallel ranks after the
    gather) is compared with the first one: ``replica_mismatches`` names each parameter some rank holds
    differently (``assert_same_training`` requires none), ``copies`` counts the ranks holding each.
    """
    losses = [r["losses"] for r in results if r["losses"]]
    copies: dict[str, int] = {}
    mismatches: list[str] = []
    params = _merge_tensors(results, "params", mismatches, copies)
    masters = _merge_tensors(results, "masters", mismatches)
    merged = {"losses": losses[0], "all_losses": losses, "grad_norms": results[-1]["grad_norms"], "params": params,
              "masters": masters, "copies": copies, "replica_mismatches": mismatches,
              "expert_biases": _merge_expert_biases(results, mismatches)}
    for key in ("loss_scales", "skipped_iterations", "nan_iterations", "moe_losses", "loss_stats"):
        if key in results[-1]:
            merged[key] = results[-1][key]
    return merged


def _merge_tensors(results: list[dict], key: str, mismatches: list[str],
                   copies: dict[str, int] | None = None) -> dict[str, torch.Tensor]:
    """The union over ranks of ``r[key]`` (``{name: tensor}``); each rank holding a tensor differently from the
    first rank holding it is named in ``mismatches``, and ``copies`` counts the ranks holding each."""
    merged: dict[str, torch.Tensor] = {}
    for rank, r in enumerate(results):
        for name, tensor in r.get(key, {}).items():
            first = merged.setdefault(name, tensor)
            if copies is not None:
                copies[name] = copies.get(name, 0) + 1
            if not torch.equal(first, tensor):
                label = name if key == "params" else f"{name} ({key})"
                mismatches.append(f"{label} of rank {rank} {r.get('coords', '')} differs by "
                                  f"{(first - tensor).abs().max().item():.3g} from the first rank holding it")
    return merged


def _merge_expert_biases(results: list[dict], mismatches: list[str]) -> list[dict[int, torch.Tensor]]:
    """Per iteration, every MoE layer's expert bias (stages hold different layers); a rank holding another value
    for a layer than the first rank holding it is named in ``mismatches`` (the update must be the same on all)."""
    merged: list[dict[int, torch.Tensor]] = []
    for rank, r in enumerate(results):
        for step, biases in enumerate(r.get("expert_biases", [])):
            if step == len(merged):
                merged.append({})
            for layer, bias in biases.items():
                first = merged[step].setdefault(layer, bias)
                if not torch.equal(first, bias):
                    mismatches.append(f"expert bias of layer {layer} at iteration {step + 1} on rank {rank} differs "
                                      f"by {(first - bias).abs().max().item():.3g} from the first rank holding it")
    return merged


def assert_same_training(reference: dict, parallel: dict, rtol: float = 1e-5, weight_atol: float = 1e-5) -> None:
    """Same losses every step, same grad norms, and the same updated weights, within float32 tolerance.

    Weights get an absolute tolerance of 1e-5 (1% of one lr=1e-3 Adam step): parameters whose exact
    gradient is zero (the key bias: softmax ignores it) receive rounding noise that Adam normalizes into
    updates of ~1e-6 whose sign differs between reduction orders. A real bug moves weights by ~lr.
    """
    torch.testing.assert_close(torch.tensor(parallel["losses"]), torch.tensor(reference["losses"]),
                               rtol=rtol, atol=0.0)
    for losses in parallel["all_losses"]:
        assert losses == parallel["losses"], "ranks that compute the loss disagree"
    assert not parallel.get("replica_mismatches"), "; ".join(parallel["replica_mismatches"])
    torch.testing.assert_close(torch.tensor(parallel["grad_norms"]), torch.tensor(reference["grad_norms"]),
                               rtol=1e-4, atol=1e-6)
    assert set(parallel["params"]) == set(reference["params"])
    for name, expected in reference["params"].items():
        torch.testing.assert_close(parallel["params"][name], expected, rtol=rtol, atol=weight_atol,
                                   msg=lambda message, name=name: f"{name}: {message}")


def assert_same_replicated_masters(reference: dict, parallel: dict, atol: float = 5e-4) -> None:
    """bf16/fp16 under tp: the same fp32 master weights of the tp-replicated parameters on every rank holding them,
    and those of the norms within ``atol`` of the single-process run's.

    A missing sequence-parallel gradient all-reduce lets each tp rank step on its own shard's partial gradient:
    the ranks' masters differ, and the norms' move by ~lr (1e-3) from the single process's. The activations differ
    by bf16 rounding between layouts, which moves the norms' masters by ~1e-4 over a few steps (0.5e-3 is half an
    lr step); matrices are held to equality across ranks only: Adam turns the rounding noise on their few
    near-zero gradients into lr-sized steps."""
    assert parallel["masters"], "the run reported no separate fp32 masters of tp-replicated parameters"
    assert not parallel["replica_mismatches"], "; ".join(parallel["replica_mismatches"])
    norms = {name: master for name, master in parallel["masters"].items() if master.ndim == 1}
    assert norms, "no norm weight among the tp-replicated masters"
    for name, master in norms.items():
        torch.testing.assert_close(master, reference["masters"][name], rtol=0, atol=atol,
                                   msg=lambda message, name=name: f"{name} (fp32 master): {message}")
