"""Packed documents through the model: a packed sample's logits are those of each document run on its own.

``document_ids`` from ``data/masks.py`` reach every layer's attention (the blockwise core); each document alone runs
plain causal attention (SDPA) from position 0, so the check shares no masking code with the packed path. The dense
fallback (taken under torch.compile) gives the same logits, a sliding window composes with the documents, and
selective and full recomputation give the same gradients, with attention dropout too (the re-run rebuilds its mask).
"""

from __future__ import annotations

import pytest
import torch

from megatron_like.config import ModelConfig
from megatron_like.data.masks import get_ltor_documents_and_position_ids
from megatron_like.model import GPTModel
from megatron_like.parallel_state import ParallelState
from megatron_like.tensor_parallel.random import seed_everything

VOCAB, EOD, S = 64, 63, 24
LLAMA = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, group_query_attention=True,
             num_query_groups=2, disable_bias_linear=True, untie_embeddings_and_output_weights=True)
MLA = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, disable_bias_linear=True,
           untie_embeddings_and_output_weights=True, multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=8,
           qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6)
FAMILIES = {"gpt": {}, "llama": LLAMA, "mla": MLA}


def model_of(**overrides) -> GPTModel:
    values = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=S, hidden_dropout=0.0,
                  attention_dropout=0.0, init_method_std=0.3) | overrides  # std 0.3: attention matters
    config = ModelConfig(**values)
    config.validate()
    return GPTModel(config, ParallelState.single_process(torch.device("cpu")), vocab_size=VOCAB, seed=5)


def packed_batch() -> torch.Tensor:
    """tokens long [2, S]: documents of 7, 1, 16 and of 11, 13 tokens, each ending with EOD."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, EOD, (2, S), generator=generator)
    for row, ends in ((0, (6, 7, 23)), (1, (10, 23))):
        tokens[row, list(ends)] = EOD
    return tokens


def separate_logits(model: GPTModel, tokens: torch.Tensor) -> torch.Tensor:
    """Logits [b, S, v] with each document of each sample run through the model alone."""
    rows = []
    for row in tokens:
        ends = (row == EOD).nonzero().flatten().tolist()
        starts = [0] + [end + 1 for end in ends[:-1]]
        rows.append(torch.cat([model(row[None, a:b + 1], torch.arange(b + 1 - a)[None])[0]
                               for a, b in zip(starts, ends)]))
    return torch.stack(rows)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_logits_equal_each_document_alone(family):
    model = model_of(**FAMILIES[family]).eval()
    tokens = packed_batch()
    documents, _, positions = get_ltor_documents_and_position_ids(tokens, EOD, reset_position_ids=True,
                                                                  reset_attention_mask=True)
    with torch.no_grad():
        expected = separate_logits(model, tokens)
        packed = model(tokens, positions, document_ids=documents)
        torch.testing.assert_close(packed, expected, rtol=1e-5, atol=1e-5)
        crossing = model(tokens, positions)  # the flag off: attention crosses the documents
    assert (crossing - expected).abs().max() > 1e-2


@pytest.mark.parametrize("backend", ["sdpa", "local"])
def test_dense_fallback_and_window_agree_with_the_blockwise_core(monkeypatch, backend):
    model = model_of(**LLAMA, window_size="4,0", attention_backend=backend).eval()
    tokens = packed_batch()
    documents, _, positions = get_ltor_documents_and_position_ids(tokens, EOD, reset_attention_mask=True)
    with torch.no_grad():
        blockwise = model(tokens, positions, document_ids=documents)
        window_only = model(tokens, positions)
        # What torch.compile takes: the dense [b, 1, s, s] mask of the same pairs.
        monkeypatch.setattr(type(model.layers[0].attention), "skips_masked_blocks", lambda *args: False)
        torch.testing.assert_close(model(tokens, positions, document_ids=documents), blockwise, rtol=1e-5,
                                   atol=1e-5)
        torch.testing.assert_close(model(tokens, positions), window_only, rtol=1e-5, atol=1e-5)
    assert (blockwise - window_only).abs().max() > 1e-2  # the documents matter under the window too


@pytest.mark.parametrize("attention_dropout", [0.0, 0.2])
@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recompute_keeps_the_documents(recompute, attention_dropout):
    tokens = packed_batch()
    documents, _, positions = get_ltor_documents_and_position_ids(tokens, EOD, reset_attention_mask=True)
    labels = torch.roll(tokens, -1, 1)

    def gradients(**overrides):
        model = model_of(**LLAMA, attention_dropout=attention_dropout, **overrides).train()
        seed_everything(3, tp_rank=0, pp_rank=0)  # the same dropout draws for each run
        loss = model(tokens, positions, labels=labels, document_ids=documents).sum()
        loss.backward()
        return {name: p.grad for name, p in model.named_parameters()} | {"loss": loss.detach()}

    expected = gradients()
    if attention_dropout:  # the dropout is on: another draw gives another loss
        seed_everything(4, tp_rank=0, pp_rank=0)
        model = model_of(**LLAMA, attention_dropout=attention_dropout).train()
        assert abs(model(tokens, positions, labels=labels, document_ids=documents).sum() - expected["loss"]) > 1e-3
    got = gradients(recompute_granularity=recompute,
                    **({"recompute_method": "uniform", "recompute_num_layers": 1} if recompute == "full" else {}))
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-6, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}")
