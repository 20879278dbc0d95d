"""Where each dropout mask comes from (``--dropout-rng``).

``megatron`` (the default; Megatron-LM's streams, tensor_parallel/random.py): replicated activations draw from
the default generator, offset per pipeline stage and shared by the tp ranks; head shards and sequence-parallel
shards draw from the tracker's per-tp-rank stream. A layout so draws other masks than one process.

``layout-independent``: a mask depends on (--seed, its site's global name, how often the site drew) and on
nothing the layout changes, so every tp x pp layout drops, per layer and per head, what one process drops:

* an activation ``[s, b, h]`` (the embedding's output, each layer's two residual branches) draws its mask over
  the whole sequence from one seed of its site; a sequence-parallel rank draws that whole mask and keeps its
  ``s / tp`` rows (tp times the random numbers of its shard: ``s b h`` per rank, no communication);
* attention runs once per head, each under the seed of its global head (the layer's site gives one seed per
  head of the model; a tp rank uses its heads' seeds): ``heads / tp`` calls of the attention core per layer
  instead of one, with the same arithmetic (on a GPU: that many kernel launches of one head each, forward and
  backward).

The sites' generators live in the tracker, so recomputation re-draws the same masks and checkpoints resume them.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from megatron_like.config import ModelConfig
from megatron_like.parallel_state import ParallelState
from megatron_like.tensor_parallel import get_rng_tracker

LAYOUT_INDEPENDENT = "layout-independent"


def sequence_dropout(x: torch.Tensor, p: float, site: str, sequence_parallel: bool, tp_rank: int,
                     tp_size: int) -> torch.Tensor:
    """Layout-independent dropout of ``x [s, b, h]`` (``[s / tp, b, h]``, this tp rank's rows, with sequence
    parallelism): the mask of the whole sequence, drawn from the next seed of ``site``, cut to this rank's rows."""
    tracker = get_rng_tracker()
    rows = x.shape[0] * tp_size if sequence_parallel else x.shape[0]
    with tracker.seeded(tracker.site_seeds(site, 1)[0]):
        keep = torch.empty((rows, *x.shape[1:]), dtype=x.dtype, device=x.device).bernoulli_(1.0 - p)
    if sequence_parallel:
        keep = keep.narrow(0, tp_rank * x.shape[0], x.shape[0])
    return x * keep * (1.0 / (1.0 - p)) if p < 1.0 else x * 0.0


def per_head_attention(attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                       q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, site: str, total_heads: int,
                       first_head: int) -> torch.Tensor:
    """``attend`` (an attention core with dropout) run head by head, each under its global head's seed.

    q ``[b, np, s, d]`` holds this rank's query heads ``first_head .. first_head + np - 1`` of ``total_heads``;
    k, v ``[b, ng, s, d]`` their key/value heads (``np / ng`` query heads share one). Returns ``[b, np, s, dv]``.
    """
    tracker = get_rng_tracker()
    seeds = tracker.site_seeds(site, total_heads)[first_head:first_head + q.shape[1]]
    per_group = q.shape[1] // k.shape[1]
    outputs = []
    for head, seed in enumerate(seeds):
        group = head // per_group
        with tracker.seeded(seed):
            outputs.append(attend(q[:, head:head + 1], k[:, group:group + 1], v[:, group:group + 1]))
    return torch.cat(outputs, dim=1)


class ActivationDropout:
    """Dropout of one site's activations ``[s, b, h]`` (``[s / tp, b, h]`` with sequence parallelism).

    ``site``: the global name of the site (``embedding``, ``layers.3.hidden``), which seeds its masks under
    ``--dropout-rng layout-independent``; under ``megatron`` the default generator (shared by the tp ranks) draws
    replicated activations and the per-tp-rank stream draws sequence shards.
    """

    def __init__(self, config: ModelConfig, ps: ParallelState, sequence_parallel: bool, site: str) -> None:
        self.p, self.site, self.sequence_parallel = config.hidden_dropout, site, sequence_parallel
        self.layout_independent = config.dropout_rng == LAYOUT_INDEPENDENT
        self.tp_rank, self.tp_size = ps.tp_rank, ps.tp_size

    def __call__(self, x: torch.Tensor, training: bool) -> torch.Tensor:
        if not training or self.p == 0.0:
            return x
        if self.layout_independent:
            return sequence_dropout(x, self.p, self.site, self.sequence_parallel, self.tp_rank, self.tp_size)
        with get_rng_tracker().fork() if self.sequence_parallel else nullcontext():
            return F.dropout(x, p=self.p, training=True)
