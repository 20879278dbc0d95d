"""The fused paths of the model (csrc kernels or their fallbacks) compute what the plain PyTorch path does."""

from __future__ import annotations

import pytest
import torch

from megatron_like.config import ModelConfig
from megatron_like.model import GPTModel
from megatron_like.parallel_state import ParallelState

PLAIN = dict(attention_backend="sdpa", bias_gelu_fusion=False, cross_entropy_loss_fusion=False)


def loss_and_grads(**overrides) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, hidden_dropout=0.0,
                         attention_dropout=0.0, **{**PLAIN, **overrides})
    model = GPTModel(config, ParallelState.single_process(), vocab_size=96, seed=7)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 96, (3, 17), generator=g)
    positions = torch.arange(16).expand(3, 16)
    loss = model(tokens[:, :-1], positions, labels=tokens[:, 1:])
    weights = torch.rand(loss.shape, generator=g)
    (loss * weights).sum().backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "overrides",
    [dict(bias_gelu_fusion=True), dict(cross_entropy_loss_fusion=True),
     dict(attention_backend="local", masked_softmax_fusion=True),
     dict(attention_backend="local", masked_softmax_fusion=False)],
    ids=["bias-gelu", "cross-entropy", "local-attention-fused-softmax", "local-attention-torch-softmax"],
)
def test_fused_path_matches_plain_path(overrides):
    reference_loss, reference_grads = loss_and_grads()
    loss, grads = loss_and_grads(**overrides)
    torch.testing.assert_close(loss, reference_loss, rtol=1e-5, atol=1e-6)
    for name, grad in reference_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


LLAMA = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, group_query_attention=True,
             num_query_groups=2, disable_bias_linear=True, rotary_percent=0.5)


def test_llama_kernels_match_pytorch_ops(monkeypatch, compiled_modules_loaded):
    """With csrc a Llama-style model runs the fused RMSNorm, SwiGLU and rotary kernels (partial rotary here),
    and its loss and gradients equal those of the PyTorch ops (MEGATRON_LIKE_NO_CSRC=1)."""
    from megatron_like.kernels import _loader

    monkeypatch.delenv(_loader.NO_CSRC_ENV, raising=False)
    _loader.refresh_environment()
    if not _loader.csrc_available():
        pytest.fail("compiled kernels are not built: run `pip install -e . --no-build-isolation`")
    used = compiled_modules_loaded
    loss, grads = loss_and_grads(**LLAMA)
    assert {"rms_norm", "swiglu", "rotary"} <= used
    monkeypatch.setenv(_loader.NO_CSRC_ENV, "1")
    _loader.refresh_environment()
    reference_loss, reference_grads = loss_and_grads(**LLAMA)
    torch.testing.assert_close(loss, reference_loss, rtol=1e-5, atol=1e-6)
    for name, grad in reference_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
