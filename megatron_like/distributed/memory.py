"""Memory accounting: bytes of parameters, gradients and optimizer state each rank holds.

ZeRO's arithmetic (Rajbhandari et al.), for the Φ parameters of one model-parallel rank and ``dp``
data-parallel ranks, with p-byte params, fp32 gradients (``main_grad``) and AdamW with fp32 masters
(K = 12 bytes per param: master, exp_avg, exp_avg_sq; K = 8 when fp32 params serve as their own master)::

    stage      params        grads        optimizer
    0          p Φ           4 Φ          K Φ
    1          p Φ           4 Φ          K Φ / dp
    2          p Φ           4 Φ / dp     K Φ / dp
    3          p Φ / dp      4 Φ / dp     K Φ / dp

:func:`theoretical_state_bytes` evaluates the table (the scale simulator's input);
:func:`measured_state_bytes` counts the tensors a run actually holds (buffers padded to multiples of dp,
so it is a little above the table). Transient buffers (ZeRO-2/3's full gradients of the buckets in use,
ZeRO-3's gathered params, activations) are not counted here; the planner adds them
(``megatron_like.planning.simulator.zero_transient_bytes``, the contract in ``docs/distributed.md``).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_like.distributed.data_parallel import DataParallel


@dataclass
class StateBytes:
    """Persistent bytes of one rank, by kind."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def theoretical_state_bytes(num_params: int, dp_size: int, zero_stage: int, param_bytes: int = 2,
                            separate_master: bool = True) -> StateBytes:
    """The ZeRO table above for ``num_params`` (Φ) parameters of one model-parallel rank."""
    optimizer_bytes_per_param = 12 if separate_master else 8
    params = param_bytes * num_params / (dp_size if zero_stage >= 3 else 1)
    grads = 4 * num_params / (dp_size if zero_stage >= 2 else 1)
    optimizer = optimizer_bytes_per_param * num_params / (dp_size if zero_stage >= 1 else 1)
    return StateBytes(int(params), int(grads), int(optimizer))


def measured_state_bytes(data_parallel: DataParallel, optimizer: object | None = None) -> StateBytes:
    """Bytes this rank's persistent buffers and optimizer state occupy.

    ``optimizer`` is a :class:`megatron_like.optimizer.DistributedOptimizer` (anything with
    ``state_bytes() -> {"master": int, "moments": int}``); AdamW creates its moments at the first step.
    """
    params = sum(b.param_data.numel() * b.param_data.element_size() for b in data_parallel.buffers)
    grads = sum(b.grad_data.numel() * b.grad_data.element_size() for b in data_parallel.buffers)
    optimizer_bytes = sum(optimizer.state_bytes().values()) if optimizer is not None else 0
    return StateBytes(params, grads, optimizer_bytes)
