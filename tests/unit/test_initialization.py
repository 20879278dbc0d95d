"""Layout-independent initialization drawn in chunks of rows, and deferred (ZeRO-3) parameters.

* ``draw_slice`` gives the bits of "draw the full fp32 weight, keep this rank's slice" for awkward shapes
  (sizes below 16, not multiples of 16, a remainder under 16 values), both split dimensions and many chunks;
  and its peak memory is one chunk, not the full weight.
* A deferred parameter holds no memory, keeps its attributes and its identity when materialized, and gets
  the eager values; pretrained values given before it is drawn are the ones it gets.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megatron_like.tensor_parallel.initialization import (
    deferred_init,
    draw_slice,
    is_deferred,
    load_initial_values,
    materialize,
    new_parameter,
    normal_init,
    rows_per_chunk,
)
from megatron_like.tensor_parallel.layers import sharded_parameter
from megatron_like.tensor_parallel.random import init_generator
from tests.peak_memory import peak_live_bytes

SHAPES = [(1, 1), (3, 5), (5, 3), (17, 1), (4, 4), (8, 9), (33, 7), (96, 13), (300, 301), (40,), (1000, 2)]


def reference_slice(shape, partition_dim, tp_rank, tp_size, seed=11) -> torch.Tensor:
    """The definition: the whole fp32 weight drawn at once, then this rank's chunk."""
    full = torch.empty(shape)
    normal_init(0.02)(full, torch.Generator().manual_seed(seed))
    return full if partition_dim is None else full.chunk(tp_size, dim=partition_dim)[tp_rank]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_draw_slice_in_chunks_equals_one_draw_bitwise(shape):
    layouts = [(None, 0, 1)] + [(dim, rank, tp) for dim in range(len(shape)) for tp in (2, 4) if shape[dim] % tp == 0
                                 for rank in range(tp)]
    # Chunks from one row (or the fewest rows giving a multiple of 16 values) to the whole weight.
    for chunk_elements in (1, 16, 48, 100, 1 << 22):
        for partition_dim, tp_rank, tp_size in layouts:
            expected = reference_slice(shape, partition_dim, tp_rank, tp_size)
            for dtype in (torch.float32, torch.bfloat16):
                out = torch.empty(expected.shape, dtype=dtype)
                draw_slice(out, normal_init(0.02), torch.Generator().manual_seed(11), shape, partition_dim,
                           tp_rank, tp_size, chunk_elements=chunk_elements)
                assert torch.equal(out, expected.to(dtype)), (chunk_elements, partition_dim, tp_rank, tp_size, dtype)


def test_rows_per_chunk_gives_multiples_of_16_values():
    for cols in (1, 3, 8, 12, 16, 17, 1000):
        rows = rows_per_chunk(cols, chunk_elements=100)
        assert rows * cols % 16 == 0 and rows * cols <= max(100, cols) + 15 * cols


def test_draw_slice_never_holds_the_full_weight():
    """A 4 MiB weight drawn in 64 KiB chunks: the peak is the output slice plus one chunk."""
    shape, chunk_elements = (4096, 256), 1 << 14
    out = torch.empty(shape[0] // 2, shape[1])  # tp rank 1 of 2, column-parallel

    def draw():
        draw_slice(out, normal_init(0.02), torch.Generator().manual_seed(3), shape, 0, 1, 2, chunk_elements)

    peak, _ = peak_live_bytes(draw)
    assert peak <= 4 * rows_per_chunk(shape[1], chunk_elements) * shape[1], peak
    assert torch.equal(out, reference_slice(shape, 0, 1, 2, seed=3))


def test_deferred_parameter_is_drawn_later_with_the_eager_values():
    args = ((12, 8), 0, None, normal_init(0.02), 5, "layers.0.mlp.fc1.weight", torch.bfloat16, torch.device("cpu"))
    eager = sharded_parameter(*args)
    with deferred_init():
        deferred = sharded_parameter(*args)
    assert deferred.is_meta and is_deferred(deferred) and deferred.tensor_model_parallel
    holder = nn.Module()
    holder.weight = deferred
    flat = torch.zeros(100, dtype=torch.bfloat16)
    materialize(deferred, flat[4:100].view(12, 8))
    assert holder.weight is deferred and not is_deferred(deferred) and deferred.tensor_model_parallel
    assert deferred.data_ptr() == flat[4:].data_ptr() and deferred.requires_grad
    # Its own autograd version counter, as `param.data = view` gives: ZeRO-3's gathers write the flat buffer
    # and must not invalidate the parameter saved for backward.
    version = deferred._version
    flat.add_(0)
    assert deferred._version == version
    assert torch.equal(deferred.detach(), eager.detach())
    # The eager value is the definition: the generator of (seed, name), whole weight, cast.
    generator = init_generator(5, "layers.0.mlp.fc1.weight")
    assert torch.equal(eager.detach(), torch.empty(12, 8).normal_(0, 0.02, generator=generator).bfloat16())


def test_values_loaded_before_drawing_are_the_ones_drawn():
    def build() -> nn.Module:
        module = nn.Module()
        module.a = new_parameter((3, 2), torch.float32, None, lambda out: out.fill_(1.0))
        module.b = new_parameter((4,), torch.float32, None, lambda out: out.fill_(2.0))
        return module

    with deferred_init():
        deferred = build()
    eager = build()
    state = {"a": torch.arange(6.0).reshape(3, 2)}
    assert load_initial_values(deferred, state) == (["b"], [])
    assert load_initial_values(eager, state) == (["b"], [])
    materialize(deferred.a, torch.empty(3, 2))
    materialize(deferred.b, torch.empty(4))
    for module in (deferred, eager):
        assert torch.equal(module.a.detach(), state["a"]) and torch.equal(module.b.detach(), torch.full((4,), 2.0))
    with pytest.raises(ValueError, match="shape"):
        load_initial_values(eager, {"a": torch.zeros(2, 3)})


def test_pretrained_gpt_body_loads_into_a_deferred_classification_model(tmp_path):
    """Fine-tuning at ZeRO-3 loads the GPT body in the model provider, before the parameters are drawn: the
    drawn model holds the checkpoint's values (load_state_dict would skip meta parameters silently)."""
    import pretrain_gpt
    from megatron_like.config import ModelConfig
    from megatron_like.distributed import DataParallel, gathered_parameters
    from megatron_like.model.classification import GPTClassificationModel, load_pretrained_gpt
    from megatron_like.parallel_state import ParallelState

    model = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
             "--max-position-embeddings", "16", "--make-vocab-size-divisible-by", "8"]
    pretrain_gpt.main(model + ["--mock-data", "--vocab-size", "64", "--train-iters", "1", "--micro-batch-size", "2",
                               "--global-batch-size", "2", "--num-workers", "0", "--eval-iters", "0",
                               "--save", str(tmp_path)])
    config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, max_position_embeddings=16)
    ps = ParallelState.single_process(torch.device("cpu"))

    def build() -> GPTClassificationModel:
        chunk = GPTClassificationModel(config, ps, vocab_size=64, num_classes=2, seed=3)
        assert load_pretrained_gpt(chunk, str(tmp_path)) == ["head_weight"]
        return chunk

    eager = build()
    with deferred_init():
        deferred = build()
    assert deferred.embedding.word_embeddings.weight.is_meta
    DataParallel([deferred], ps, zero_stage=3)
    fresh = GPTClassificationModel(config, ps, vocab_size=64, num_classes=2, seed=3)
    with gathered_parameters([deferred]):
        for name, value in eager.state_dict().items():
            assert torch.equal(deferred.state_dict()[name], value), name
    # The body is the checkpoint's (trained one step), not the fresh draw; the head is the fresh draw.
    assert not torch.equal(eager.layers[0].mlp.fc1.weight, fresh.layers[0].mlp.fc1.weight)
    assert torch.equal(eager.head_weight, fresh.head_weight)
