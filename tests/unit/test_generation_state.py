"""Layout-independent weights: partition rules from the parameters, checkpoints of any (tp, pp, vp)
layout merge back to the same full weights and load into a model of another layout."""

from __future__ import annotations

import os

import pytest
import torch

from megatron_like.config import Config, ModelConfig
from megatron_like.inference import load_inference_model
from megatron_like.model import GPTModel
from megatron_like.model.gpt import chunk_layers
from megatron_like.model.state import (
    TRACKER_FILE,
    chunk_state,
    gather_full_state,
    load_full_state,
    partition_dim,
)
from megatron_like.parallel_state import ParallelState


def chunks_of(full: dict[str, torch.Tensor], config: Config, tp_rank: int, pp_rank: int,
              padded: int) -> list[dict[str, torch.Tensor]]:
    """The chunk state dicts rank (tp_rank, pp_rank) of ``config``'s layout holds (one per virtual stage)."""
    p, m = config.parallel, config.model
    pp, vp = p.pipeline_model_parallel_size, config.virtual_pipeline_size
    return [chunk_state(full, m, layers=chunk_layers(m.num_layers, pp, pp_rank, vp, v),
                        pre_process=pp_rank == 0 and v == 0, post_process=pp_rank == pp - 1 and v == vp - 1,
                        tp_size=p.tensor_model_parallel_size, tp_rank=tp_rank, padded_vocab_size=padded)
            for v in range(vp)]


def write_checkpoint(root: str, config: Config, full: dict[str, torch.Tensor], padded: int) -> None:
    """A checkpoint in ``config``'s layout, as training would save it (model part only)."""
    p = config.parallel
    for pp_rank in range(p.pipeline_model_parallel_size):
        for tp_rank in range(p.tensor_model_parallel_size):
            path = os.path.join(root, "iter_0000007", f"mp_rank_{tp_rank:02d}_{pp_rank:03d}")
            os.makedirs(path)
            torch.save({"config": config.to_dict(), "model": chunks_of(full, config, tp_rank, pp_rank, padded)},
                       os.path.join(path, "model_optim_rng.pt"))
    with open(os.path.join(root, TRACKER_FILE), "w") as f:
        f.write("7\n")


def make_config(tp: int, pp: int, vp_layers: int | None = None, untie: bool = False) -> Config:
    config = Config()
    config.model = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16,
                               vocab_size=100, make_vocab_size_divisible_by=8,
                               untie_embeddings_and_output_weights=untie)
    config.parallel.tensor_model_parallel_size, config.parallel.pipeline_model_parallel_size = tp, pp
    config.parallel.num_layers_per_virtual_pipeline_stage = vp_layers
    config.data.mock_data = True
    return config


def test_partition_rules_come_from_the_parameters():
    assert partition_dim("layers.3.attention.qkv.weight") == 0
    assert partition_dim("layers.0.attention.proj.weight") == 1
    assert partition_dim("layers.1.mlp.fc2.bias") is None
    assert partition_dim("embedding.word_embeddings.weight") == 0
    assert partition_dim("embedding.position_embeddings.weight") is None
    with pytest.raises(KeyError):
        partition_dim("layers.0.mystery.weight")


@pytest.mark.parametrize("tp,pp,vp,untie", [(2, 2, None, False), (2, 2, 1, True), (1, 4, None, False)])
def test_any_layout_merges_back_and_loads_into_another(tmp_path, tp, pp, vp, untie):
    config = make_config(tp, pp, vp, untie)
    ps = ParallelState.single_process(torch.device("cpu"))
    reference = GPTModel(config.model, ps, vocab_size=104, seed=1).eval()  # 100 padded to 8 -> 104
    full = gather_full_state([reference])
    padded_saved = config.padded_vocab_size(100)  # 112 at tp=2: a different padding than tp=1
    write_checkpoint(str(tmp_path), config, full, padded_saved)
    saved, merged = load_full_state(str(tmp_path))
    assert saved.parallel.tensor_model_parallel_size == tp and set(merged) == set(full)
    for name, tensor in full.items():
        got = merged[name][: tensor.shape[0]] if "word" in name or "output_layer" in name else merged[name]
        assert torch.equal(got, tensor), name
    _, stage = load_full_state(str(tmp_path), layers=[2, 3])  # one pipeline stage's share
    assert set(stage) == {k for k in full if not k.startswith("layers.") or k.startswith(("layers.2.", "layers.3."))}
    assert all(torch.equal(stage[k], merged[k]) for k in stage)
    loaded = load_inference_model(str(tmp_path), ps)
    assert loaded.vocab_size == 100 and loaded.tokenizer is None and loaded.eod is None
    ids = torch.randint(0, 100, (2, 9))
    pos = torch.arange(9)[None].expand(2, -1)
    with torch.no_grad():
        torch.testing.assert_close(loaded.model[0](ids, pos)[..., :100], reference(ids, pos)[..., :100])
