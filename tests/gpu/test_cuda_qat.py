"""QAT int8 on CUDA at decode shapes: ``torch._int_mm`` refuses 16 rows or fewer and sizes that are not multiples
of 8 there, so the int8 linears pad their operands (megatron_like/quantization/qat.py, ``padded_int_mm``)."""

from __future__ import annotations

import copy

import pytest
import torch

from megatron_like.inference import GenerationParams, generate
from megatron_like.parallel_state import ParallelState
from megatron_like.quantization import convert_to_int8, insert_fake_quant
from megatron_like.quantization.qat import exact_int8_mm
from tests.gpu._models import PROMPTS, VOCAB, assert_greedy_on, tiny


@pytest.mark.parametrize(("m", "k", "n"), [(1, 64, 192), (1, 20, 12), (3, 64, 64), (16, 128, 8), (17, 64, 64),
                                           (40, 72, 24)])
def test_int8_mm_on_cuda_is_exact_at_every_shape(m, k, n, device):
    gen = torch.Generator().manual_seed(m + k + n)
    a = torch.randint(-127, 128, (m, k), generator=gen, dtype=torch.int8)
    weight = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    got = exact_int8_mm(a.to(device), weight.to(device).t())
    assert got.dtype == torch.int32 and got.device == device
    assert torch.equal(got.cpu().long(), a.long() @ weight.t().long())


def test_int8_model_decodes_on_cuda_like_its_fake_quant_model(device):
    """A QAT model converted to int8 on CUDA generates token by token (decode steps of 1-3 rows through
    torch._int_mm) the tokens its fake-quant twin ranks best."""
    ps = ParallelState.single_process(device)
    model = tiny(ps)
    insert_fake_quant(model, ps)
    calibration = torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(5)).to(device)
    with torch.no_grad():
        model.train()(calibration, torch.arange(32, device=device).expand(4, -1))  # sets the activation ranges
    fake_quant = copy.deepcopy(model).eval()
    convert_to_int8(model)
    generated = generate(model, PROMPTS, GenerationParams(max_new_tokens=8), vocab_size=VOCAB)
    for prompt, (generation,) in zip(PROMPTS, generated):
        assert len(generation.token_ids) == 8
        assert_greedy_on(fake_quant, prompt, generation.token_ids)
