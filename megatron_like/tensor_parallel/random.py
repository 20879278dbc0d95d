"""Random numbers that make parallel runs reproducible.

* Weight init: every weight is drawn whole from its own generator, seeded by the run seed and the
  weight's global name (``init_generator``), and each rank keeps its slice. So tp=N holds exact slices of
  the tp=1 model and a pipeline stage draws the same layers as the single-process model.
* Dropout, ``--dropout-rng megatron`` (Megatron-LM's streams): the default generator is shared by the ranks of
  a tensor-parallel group (replicated activations must drop the same elements) and offset per pipeline stage;
  dropout on tensor-parallel shards (attention heads, or sequence-parallel chunks) runs inside
  ``get_rng_tracker().fork()``, a per-tp-rank stream. The masks so depend on the layout.
* Dropout, ``--dropout-rng layout-independent``: every dropout site (the embedding, each layer's hidden dropout,
  each layer's attention) has its own CPU generator seeded by (--seed, the site's global name), which gives the
  seed of each mask (``RNGStatesTracker.site_seeds``; per global head for attention). Every tp rank and pipeline
  stage so draws, for its layers and heads, the masks one process draws (model/dropout.py).
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator

import torch

MODEL_PARALLEL_RNG = "model-parallel-rng"
SITE_PREFIX = "site:"
"""Prefix of a dropout site's generator state among the tracker's states (checkpoints, recompute)."""


def init_generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator private to one weight: same (seed, name) gives the same draws on every rank."""
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))


class RNGStatesTracker:
    """Named generator states that can be swapped in for a region of code (Megatron's tracker).

    The tracker swaps the *default* generator of the device, so ``torch.nn.functional.dropout`` and
    ``scaled_dot_product_attention`` need no generator argument.
    """

    def __init__(self) -> None:
        self.states: dict[str, torch.Tensor] = {}
        self.device_type = "cpu"
        self.site_seed: int | None = None
        self.sites: dict[str, torch.Generator] = {}

    def reset(self, device_type: str = "cpu", site_seed: int | None = None) -> None:
        self.states = {}
        self.device_type = device_type
        self.site_seed, self.sites = site_seed, {}

    def _get_state(self) -> torch.Tensor:
        return torch.cuda.get_rng_state() if self.device_type == "cuda" else torch.get_rng_state()

    def _set_state(self, state: torch.Tensor) -> None:
        if self.device_type == "cuda":
            torch.cuda.set_rng_state(state)
        else:
            torch.set_rng_state(state)

    def add(self, name: str, seed: int) -> None:
        if name in self.states:
            raise ValueError(f"RNG state {name!r} already exists")
        saved = self._get_state()
        if self.device_type == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        self.states[name] = self._get_state()
        self._set_state(saved)

    def get_states(self) -> dict[str, torch.Tensor]:
        """The named device states and the dropout sites' generator states (``site:`` + the site's name)."""
        sites = {SITE_PREFIX + name: generator.get_state() for name, generator in self.sites.items()}
        return {**{name: state.clone() for name, state in self.states.items()}, **sites}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {name: state.clone() for name, state in states.items() if not name.startswith(SITE_PREFIX)}
        self.sites = {}
        for name, state in states.items():
            if name.startswith(SITE_PREFIX):
                self.sites[name[len(SITE_PREFIX):]] = torch.Generator().set_state(state.clone())

    def site_seeds(self, site: str, count: int) -> list[int]:
        """The next ``count`` mask seeds of dropout site ``site`` (a global name, e.g. ``layers.3.attention``).

        Each site is a CPU generator seeded by (--seed, site), created at its first use: a stage that holds
        layer 3 draws layer 3's seeds whatever else it holds, and no device synchronizes to read them.
        """
        if self.site_seed is None:
            raise KeyError(f"dropout site {site!r}: the tracker was never seeded (call seed_everything first)")
        if site not in self.sites:
            self.sites[site] = init_generator(self.site_seed, "dropout." + site)
        return torch.randint(0, 2**62, (count,), generator=self.sites[site]).tolist()

    @contextlib.contextmanager
    def seeded(self, seed: int) -> Iterator[None]:
        """Run the body with the device's default generator seeded by ``seed``; restore its state after."""
        outside = self._get_state()
        if self.device_type == "cuda":
            torch.cuda.manual_seed(seed)  # this device's generator only
        else:
            torch.default_generator.manual_seed(seed)
        try:
            yield
        finally:
            self._set_state(outside)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Run the body with generator ``name``; its advanced state is kept for next time."""
        if name not in self.states:
            raise KeyError(f"RNG state {name!r} was never added (call seed_everything first)")
        outside = self._get_state()
        self._set_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = self._get_state()
            self._set_state(outside)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process's tracker. Global like the default generator it swaps, and for the same reason."""
    return _TRACKER


def seed_everything(seed: int, tp_rank: int, pp_rank: int, device_type: str = "cpu") -> None:
    """Seed python, numpy and torch; give tensor-parallel regions a per-tp-rank stream.

    Megatron's offsets: the default stream differs per pipeline stage (different layers must not draw
    identical dropout masks) and is shared by tensor-parallel ranks; the tracker stream differs per tp rank.
    """
    import random

    import numpy as np

    default_seed = seed + 100 * pp_rank
    random.seed(default_seed)
    np.random.seed(default_seed % (2**32))
    torch.manual_seed(default_seed)
    if device_type == "cuda":
        torch.cuda.manual_seed(default_seed)
    tracker = get_rng_tracker()
    tracker.reset(device_type, site_seed=seed)  # dropout sites: the same on every rank (layout-independent)
    tracker.add(MODEL_PARALLEL_RNG, default_seed + 2718 + tp_rank)


# --------------------------------------------------------------------------------------------------
# Activation recomputation
# --------------------------------------------------------------------------------------------------

_recompute_depth = 0


def is_recomputing() -> bool:
    """True while a :func:`checkpoint` re-runs its function inside backward (ZeRO-3 keeps params then)."""
    return _recompute_depth > 0


def _capture_rng_states() -> dict[str, object]:
    tracker = get_rng_tracker()
    states: dict[str, object] = {"cpu": torch.get_rng_state(), "tracker": tracker.get_states()}
    if tracker.device_type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _restore_rng_states(states: dict[str, object]) -> None:
    torch.set_rng_state(states["cpu"])
    if "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"])
    get_rng_tracker().set_states(states["tracker"])


class _CheckpointFunction(torch.autograd.Function):
    """Forward without keeping activations; backward re-runs forward with the same RNG states, then
    backpropagates through the re-run (Megatron's reentrant checkpoint)."""

    @staticmethod
    def forward(ctx, run_function, *args):
        ctx.run_function = run_function
        # Everything the function draws from: the default generator and the tracker's streams. Restored
        # on recompute, so dropout masks are identical and gradients are bitwise those without recompute.
        ctx.rng_states = _capture_rng_states()
        ctx.tensor_positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.other_args = [None if isinstance(a, torch.Tensor) else a for a in args]
        ctx.save_for_backward(*(args[i] for i in ctx.tensor_positions))
        with torch.no_grad():
            return run_function(*args)

    @staticmethod
    def backward(ctx, *grad_outputs):
        global _recompute_depth
        args = list(ctx.other_args)
        for i, saved in zip(ctx.tensor_positions, ctx.saved_tensors):
            args[i] = saved.detach().requires_grad_(saved.requires_grad)
        outside = _capture_rng_states()
        _restore_rng_states(ctx.rng_states)
        _recompute_depth += 1
        try:
            with torch.enable_grad():
                outputs = ctx.run_function(*args)
        finally:
            _recompute_depth -= 1
            _restore_rng_states(outside)
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if isinstance(o, torch.Tensor) and o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        grads = [args[i].grad if isinstance(args[i], torch.Tensor) else None for i in range(len(args))]
        return (None, *grads)


def checkpoint(function, *args):
    """``function(*args)`` without storing its activations; they are recomputed in backward.

    Recompute-safe for dropout: the CPU/CUDA generator and the tracker states are saved at forward and
    restored for the re-run. At least one tensor argument must require grad (the hidden states do).
    """
    return _CheckpointFunction.apply(function, *args)
