"""Bytes of the tensors autograd keeps for backward, counted with its saved-tensor hooks (what the planner's
per-layer activation formula, ``planning/activations.py``, is checked against), and the bytes a zero-bubble B step
leaves for its W (the planner's W stash, ``planning/split_backward.py``)."""

from __future__ import annotations


def kept_for_backward(config, document_ids=None, ps=None) -> int:
    """Bytes one TransformerLayer of ``config`` keeps for backward on ``[s, b, h]`` (``--seq-length``,
    ``--micro-batch-size``, ``--hidden-size``; the autograd saved-tensor hooks, parameters excluded, each storage
    once); ``document_ids`` int64 ``[b, s]``: packed documents. ``ps``: a tensor-parallel rank's state (one process
    when None); with ``--sequence-parallel`` the input is its ``[s / tp, b, h]`` shard."""
    import torch

    layer, x = layer_and_input(config, ps)
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        layer(x, document_ids=document_ids)
    return sum(saved.values())


def layer_and_input(config, ps=None):
    """One TransformerLayer of ``config`` on tp rank ``ps`` (one process when None) and a random input ``[s, b, h]``
    (its ``[s / tp, b, h]`` shard with ``--sequence-parallel``) that requires grad; the tracker seeded, as attention
    dropout draws from its stream."""
    import torch

    from megatron_like.model.transformer import TransformerLayer
    from megatron_like.parallel_state import ParallelState
    from megatron_like.tensor_parallel.random import seed_everything

    dtype = torch.bfloat16 if config.precision.bf16 else torch.float32
    ps = ParallelState.single_process(torch.device("cpu")) if ps is None else ps
    sequence_parallel = config.parallel.sequence_parallel
    layer = TransformerLayer(config.model, ps, 0, 1, sequence_parallel, dtype)
    m = config.model
    s = m.seq_length // (ps.tp_size if sequence_parallel else 1)
    x = torch.randn(s, config.training.micro_batch_size, m.hidden_size, dtype=dtype, requires_grad=True)
    seed_everything(1, tp_rank=ps.tp_rank, pp_rank=0)
    return layer, x


def kept_for_weight_grads(config, ps=None, keep_gathered: bool = False) -> int:
    """Bytes the W work of one TransformerLayer of ``config`` keeps from its B (``WeightGradWork.kept_bytes``: every
    deferred GEMM's input and output gradient), on tp rank ``ps`` as :func:`kept_for_backward`; ``keep_gathered``:
    ``--keep-gathered-sequence-for-wgrad``."""
    from megatron_like.tensor_parallel import weight_grad

    layer, x = layer_and_input(config, ps)
    with weight_grad.split_backward(keep_gathered):
        y = layer(x)
        with weight_grad.deferring_weight_grads(list(layer.parameters())) as work:
            y.sum().backward()
    assert work.closures, "the layer deferred no weight gradient"
    return work.kept_bytes
