"""Quantization-aware training: the quantizers, QAT fine-tuning against fp32, int8 export against fake quant.

Stated bounds (measured values in docs/workflows.md):
* the exported int8 model's logits are within 1e-4 (absolute) of the fake-quant model's on the same input
  (the same arithmetic, exact int32 accumulation instead of float);
* a QAT fine-tune of a small GPT ends within 2% of the validation perplexity of the same fp32 fine-tune.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from megatron_like.quantization import ActivationFakeQuant, WeightFakeQuant, fake_quant, int8_matmul, qat, quantize

INT8_LOGIT_ATOL = 1e-4
QAT_PPL_RTOL = 0.02


def test_weight_fake_quant_is_per_channel_symmetric_with_straight_through_grad():
    weight = (torch.randn(6, 10) * torch.arange(1, 7).unsqueeze(1)).requires_grad_()
    quantizer = WeightFakeQuant()
    scale = quantizer.scale(weight)
    torch.testing.assert_close(scale.squeeze(1), weight.detach().abs().amax(1) / 127)
    out = quantizer(weight)
    codes = out.detach() / scale
    torch.testing.assert_close(codes, codes.round(), atol=1e-4, rtol=0)
    assert (codes.abs().amax(1).round() == 127).all()  # each row's largest weight maps to +-127
    assert ((out - weight).abs() <= scale / 2 + 1e-7).all()
    out.sum().backward()
    torch.testing.assert_close(weight.grad, torch.ones_like(weight))  # straight-through


def test_activation_range_is_a_moving_average_and_float_checkpoints_load():
    quantizer = ActivationFakeQuant(moving_rate=0.9)
    quantizer(torch.tensor([1.0, -2.0]))
    assert quantizer.amax.item() == pytest.approx(2.0)
    quantizer(torch.tensor([4.0]))
    assert quantizer.amax.item() == pytest.approx(0.9 * 2.0 + 0.1 * 4.0)
    quantizer.eval()
    x = torch.tensor([10.0, 0.3])
    assert quantizer(x)[0].item() == pytest.approx(2.2)  # clipped to the stored range in eval
    module = torch.nn.Sequential(torch.nn.Linear(2, 2))
    state = module.state_dict()
    module[0].q = ActivationFakeQuant()
    module.load_state_dict(state)  # strict: a float checkpoint has no ranges, nothing is reported missing
    assert not module[0].q.initialized


def test_int8_matmul_equals_fake_quant_matmul():
    x, weight = torch.randn(5, 3, 16), torch.randn(8, 16)
    weight_scale = WeightFakeQuant().scale(weight)
    input_scale = x.abs().amax() / 127
    expected = fake_quant(x, input_scale) @ fake_quant(weight, weight_scale).t()
    got = int8_matmul(x, quantize(weight, weight_scale), weight_scale.squeeze(1), input_scale)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


_EXACTNESS_CHECK = """
import torch
from megatron_like.quantization.qat import exact_int8_mm
g = torch.Generator().manual_seed(0)
for m, k, n in ((15, 16, 8), (3, 2500, 5)):  # k = 2500 spans three float32 chunks
    a = torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int8)
    b = torch.randint(-127, 128, (k, n), generator=g, dtype=torch.int8)
    extreme = torch.full((m, k), 127, dtype=torch.int8), torch.full((k, n), -127, dtype=torch.int8)
    for x, y in ((a, b), extreme):
        got = exact_int8_mm(x, y)
        assert got.dtype == torch.int32 and torch.equal(got.long(), x.long() @ y.long()), (m, k, n)
print("exact")
"""


ONEDNN_CAPS = [None, "AVX2"]


@pytest.fixture(scope="module")
def exactness_checks() -> dict:
    """``_EXACTNESS_CHECK`` in a fresh Python per oneDNN ISA cap (the cap holds from process start), all at once."""
    import os
    import sys

    from tests.subprocesses import run_at_once

    runs = {}
    for cap in ONEDNN_CAPS:
        env = dict(os.environ)
        if cap:
            env["ONEDNN_MAX_CPU_ISA"] = cap
        runs[cap] = {"args": [sys.executable, "-c", _EXACTNESS_CHECK], "env": env}
    return run_at_once(runs, timeout=120)


@pytest.mark.parametrize("onednn_isa", ONEDNN_CAPS)
def test_int8_products_are_exact_on_any_cpu(exactness_checks, onednn_isa):
    """The int8 GEMM equals int64 arithmetic, also with oneDNN held to AVX2 (no VNNI), where torch._int_mm's
    int16 pair sums saturate (it was off by 22261 on random codes); run in a subprocess so the ISA cap holds."""
    proc = exactness_checks[onednn_isa]
    assert proc.returncode == 0 and proc.stdout.strip() == "exact", proc.stderr


@pytest.mark.parametrize("m", [0, 1, 7, 16, 17, 40])
@pytest.mark.parametrize(("k", "n"), [(1, 1), (8, 8), (20, 12), (64, 3), (130, 64)])
def test_int_mm_shape_is_the_smallest_cuda_accepts(m, k, n):
    rows, inner, cols = qat.int_mm_shape(m, k, n)
    assert rows > 16 and inner % 8 == 0 < inner and cols % 8 == 0 < cols  # torch._int_mm's CUDA checks
    # ... and no larger than needed: one multiple of 8 less would cut into the real sizes.
    assert rows == max(m, 17)
    assert inner >= k and (inner == 8 or inner - 8 < k)
    assert cols >= n and (cols == 8 or cols - 8 < n)


def _int_mm_with_cuda_checks(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch._int_mm's CUDA contract (aten/src/ATen/native/cuda/Blas.cpp's checks), computed exactly on CPU."""
    (m, k), n = a.shape, b.shape[1]
    if not (m > 16 and k > 0 and k % 8 == 0 and n > 0 and n % 8 == 0 and b.shape[0] == k):
        raise RuntimeError(f"torch._int_mm on CUDA refuses [{m}, {k}] @ [{b.shape[0]}, {n}]")
    assert a.dtype == b.dtype == torch.int8
    return (a.long() @ b.long()).to(torch.int32)


@pytest.mark.parametrize(("m", "k", "n"), [(1, 64, 64), (3, 20, 12), (16, 8, 24), (17, 8, 8), (0, 16, 8)])
def test_int8_mm_off_cpu_meets_cuda_shape_rules_exactly(monkeypatch, m, k, n):
    """Decode steps (few rows) and odd sizes reach torch._int_mm padded to a shape CUDA accepts, sliced back."""
    monkeypatch.setattr(torch, "_int_mm", _int_mm_with_cuda_checks)
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    a = torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int8)
    weight = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    got = qat.padded_int_mm(a, weight.t())
    assert got.dtype == torch.int32 and got.shape == (m, n)
    assert torch.equal(got.long(), a.long() @ weight.t().long())


BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "8", "--mock-data", "--vocab-size", "256", "--make-vocab-size-divisible-by", "8",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "100", "--num-workers", "0",
        "--eval-iters", "8"]


def run_gpt(flags: list[str]):
    import pretrain_gpt
    from megatron_like.config import parse_config
    from megatron_like.training import pretrain

    config = parse_config(BASE + flags, world_size=1)
    vocab = config.padded_vocab_size(config.model.vocab_size)
    provider = functools.partial(pretrain_gpt.model_provider, padded_vocab_size=vocab)
    return pretrain(config, provider, pretrain_gpt.forward_step, pretrain_gpt.datasets_provider,
                    padded_vocab_size=vocab)


def test_qat_finetune_close_to_fp32_and_int8_export_matches_fake_quant(tmp_path):
    from megatron_like.data.mock_dataset import MockGPTDataset
    from megatron_like.quantization.export import export_int8, load_int8_model

    run_gpt(["--train-iters", "20", "--lr", "2e-3", "--save", str(tmp_path / "fp32"), "--eval-interval", "20"])
    finetune = ["--train-iters", "20", "--lr", "5e-4", "--load", str(tmp_path / "fp32"), "--finetune",
                "--eval-interval", "20"]
    fp32 = run_gpt(finetune)
    qat = run_gpt(finetune + ["--qat", "--save", str(tmp_path / "qat")])
    ppl_fp32, ppl_qat = math.exp(fp32.validation_losses[-1]), math.exp(qat.validation_losses[-1])
    assert abs(ppl_qat - ppl_fp32) / ppl_fp32 < QAT_PPL_RTOL, (ppl_qat, ppl_fp32)

    state = export_int8(str(tmp_path / "qat"), str(tmp_path / "int8.safetensors"))
    assert state["layers.0.attention.qkv.weight_int8"].dtype == torch.int8
    assert state["layers.1.mlp.fc2.weight_scale"].shape == (64,)
    assert not any(k.endswith("qkv.weight") for k in state)  # no float copy of a quantized weight
    int8_model, _ = load_int8_model(str(tmp_path / "int8.safetensors"))
    fake_quant_model = qat.model[0].eval()
    dataset = MockGPTDataset(8, 32, 256, seed=99)
    text = torch.stack([torch.from_numpy(dataset[i]["text"]) for i in range(8)])
    tokens, labels = text[:, :-1], text[:, 1:]
    positions = torch.arange(32).expand_as(tokens)
    with torch.no_grad():
        expected, got = fake_quant_model(tokens, positions), int8_model(tokens, positions)
        loss_fake = fake_quant_model(tokens, positions, labels=labels).mean()
        loss_int8 = int8_model(tokens, positions, labels=labels).mean()
    assert (got - expected).abs().max().item() < INT8_LOGIT_ATOL
    assert loss_int8.item() == pytest.approx(loss_fake.item(), abs=INT8_LOGIT_ATOL)
