"""--cpu-gemm-backend: oneDNN and MKL linears give the same numbers, and the chosen one is the one that runs.

The op counts come from a TorchDispatchMode (every aten op a step runs): oneDNN's linear is
``mkldnn._linear_pointwise``, MKL's shows up as ``mm``/``addmm``. No timings.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_like.config import ConfigError, ModelConfig, parse_config
from megatron_like.model import GPTModel
from megatron_like.parallel_state import ParallelState
from megatron_like.tensor_parallel import cpu_gemm

pytestmark = pytest.mark.skipif(not cpu_gemm.onednn_available(), reason="torch built without oneDNN")

VOCAB = 128


class OpCounter(TorchDispatchMode):
    """Counts the aten ops run under it by name (``mkldnn._linear_pointwise``, ``aten.mm``, ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[f"{func.namespace}.{func.overloadpacket.__name__}"] += 1
        return func(*args, **(kwargs or {}))


def llama(backend: str) -> GPTModel:
    config = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, hidden_dropout=0.0,
                         attention_dropout=0.0, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                         group_query_attention=True, num_query_groups=2, disable_bias_linear=True,
                         ffn_hidden_size=96, untie_embeddings_and_output_weights=True, cpu_gemm_backend=backend)
    config.validate()
    return GPTModel(config, ParallelState.single_process(torch.device("cpu")), vocab_size=VOCAB, seed=5)


def train_step(model: GPTModel) -> tuple[torch.Tensor, dict[str, torch.Tensor], collections.Counter[str]]:
    ids = torch.randint(0, VOCAB, (3, 17), generator=torch.Generator().manual_seed(0))
    with OpCounter() as counter:
        loss = model(ids[:, :-1], None, labels=ids[:, 1:]).mean()
        loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}, counter.counts


def test_onednn_linear_equals_f_linear_forward_and_backward():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(16, 3, 40, generator=generator).transpose(0, 1)  # (3, 16, 40), not contiguous
    weight, bias = torch.randn(24, 40, generator=generator), torch.randn(24, generator=generator)
    results = []
    for backend in ("onednn", "mkl"):
        leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
        y = cpu_gemm.linear(*leaves, cpu_gemm.resolve_backend(backend))
        y.backward(torch.cos(y.detach()))
        results.append([y.detach()] + [t.grad for t in leaves])
    for ours, expected in zip(*results):
        torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)


def test_chosen_backend_runs_and_models_agree():
    """Every tp linear's forward and input gradient go through oneDNN when chosen, none with mkl; the loss and
    gradients agree within fp32 rounding. 9 linears (4 per layer + output layer): 18 oneDNN calls per step."""
    loss_dnn, grads_dnn, ops_dnn = train_step(llama("onednn"))
    loss_mkl, grads_mkl, ops_mkl = train_step(llama("mkl"))
    assert ops_dnn["mkldnn._linear_pointwise"] == 18
    assert ops_mkl["mkldnn._linear_pointwise"] == 0
    assert ops_dnn["aten.mm"] == 9  # the weight gradients stay with mm
    torch.testing.assert_close(loss_dnn, loss_mkl, rtol=1e-6, atol=1e-6)
    for name, grad in grads_dnn.items():
        torch.testing.assert_close(grad, grads_mkl[name], rtol=1e-4, atol=1e-6, msg=name)


def test_auto_rule(monkeypatch):
    """auto = oneDNN (from ONEDNN_MIN_MACS up) on AMD, MKL elsewhere: decided by the vendor, never by a timing."""
    monkeypatch.setattr(cpu_gemm, "cpu_vendor", lambda: "AuthenticAMD")
    assert cpu_gemm.resolve_backend("auto") == "auto_onednn"
    monkeypatch.setattr(cpu_gemm, "cpu_vendor", lambda: "GenuineIntel")
    assert cpu_gemm.resolve_backend("auto") == "mkl"
    assert cpu_gemm.resolve_backend("onednn") == "onednn"
    # Below the size floor auto stays with MKL (the tiny test model above); from it on, oneDNN.
    weight = torch.randn(64, 64)
    for rows, expected in ((8, 0), (cpu_gemm.ONEDNN_MIN_MACS // 64 // 64, 1)):
        with OpCounter() as counter:
            cpu_gemm.linear(torch.randn(rows, 64), weight, None, "auto_onednn")
        assert counter.counts["mkldnn._linear_pointwise"] == expected


def test_flag_and_errors(monkeypatch):
    data = ["--mock-data", "--vocab-size", "128"]
    assert parse_config(data + ["--cpu-gemm-backend", "mkl"], world_size=1).model.cpu_gemm_backend == "mkl"
    assert parse_config(data, world_size=1).model.cpu_gemm_backend == "auto"
    monkeypatch.setattr(cpu_gemm, "onednn_available", lambda: False)
    with pytest.raises(ConfigError, match="--cpu-gemm-backend onednn: this torch build has no oneDNN"):
        ModelConfig(cpu_gemm_backend="onednn").validate()
    assert cpu_gemm.resolve_backend("auto") == "mkl"
