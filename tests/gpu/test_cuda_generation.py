"""Generation on CUDA (KV cache, one-token decode steps through the CUDA twins) picks the tokens the same weights
pick on the CPU (:func:`tests.gpu._models.assert_greedy_on` explains the check)."""

from __future__ import annotations

import pytest
import torch

from megatron_like.inference import GenerationParams, generate
from megatron_like.kernels import _loader
from megatron_like.parallel_state import ParallelState
from tests.gpu._models import MODELS, PROMPTS, VOCAB, assert_greedy_on, tiny


@pytest.mark.parametrize("name", sorted(MODELS))
def test_greedy_generation_on_cuda_picks_the_cpu_model_tokens(name, device, twins_used):
    cpu_model = tiny(ParallelState.single_process(torch.device("cpu")), **MODELS[name])
    cuda_model = tiny(ParallelState.single_process(device), **MODELS[name])
    cuda_model.load_state_dict(cpu_model.state_dict())
    generated = generate(cuda_model, PROMPTS, GenerationParams(max_new_tokens=12), vocab_size=VOCAB)
    for prompt, (generation,) in zip(PROMPTS, generated):
        assert len(generation.token_ids) == 12
        assert_greedy_on(cpu_model, prompt, generation.token_ids)
    if name == "llama":
        assert {_loader.CUDA_MODULE_PREFIX + op for op in ("rms_norm", "swiglu", "rotary")} <= twins_used
