"""The split backward of the zero-bubble schedules (tensor_parallel/weight_grad.py) on whole GPT, Llama and MoE
models in one process: a B step leaves every ``.grad`` untouched and defers the weight gradient of every GEMM
(linears, embeddings, router, experts' grouped GEMM; not the output layer's, see gpt.py); the W step then gives
the gradients of a plain backward, each parameter's accumulated once."""

from __future__ import annotations

import pytest
import torch

from megatron_like.config import ModelConfig
from megatron_like.model import GPTModel
from megatron_like.parallel_state import ParallelState
from megatron_like.tensor_parallel import weight_grad

LLAMA = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, disable_bias_linear=True,
             untie_embeddings_and_output_weights=True, ffn_hidden_size=48)
MOE = dict(LLAMA, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16)
MODELS = {"gpt": {}, "llama": LLAMA, "moe": MOE, "moe-grouped-gemm": dict(MOE, moe_grouped_gemm=True)}


def build(overrides: dict) -> GPTModel:
    config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8,
                         max_position_embeddings=8, hidden_dropout=0.0, attention_dropout=0.0, **overrides)
    config.validate()
    return GPTModel(config, ParallelState.single_process(torch.device("cpu")), vocab_size=64, seed=3)


def loss_of(model: GPTModel, tokens: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    return model(tokens, positions, labels=tokens.roll(-1, dims=1)).float().mean()


@pytest.mark.parametrize("name", list(MODELS))
def test_b_defers_every_gemm_weight_and_w_gives_the_plain_gradients(name):
    model = build(MODELS[name])
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    loss_of(model, tokens).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    params = list(model.parameters())
    with weight_grad.split_backward():
        loss = loss_of(model, tokens)
        with weight_grad.deferring_weight_grads(params) as work:
            loss.backward()
    assert all(p.grad is None for p in params), "B wrote a weight gradient"
    names = {id(p): n for n, p in model.named_parameters()}
    parked = {names[id(p)] for p, _ in work.parked}
    # Every GEMM weight but the output layer's (its W would keep the logits' gradient: gpt.py); with tied
    # embeddings in one process that is the word embedding, whose lookup part is deferred (the untied models show).
    output_weight = model.output_layer.weight if model.output_layer.weight is not None else \
        model.embedding.word_embeddings.weight
    gemm_weights = {n for n, p in model.named_parameters() if p.dim() >= 2 and p is not output_weight}
    assert not parked & gemm_weights, f"computed in B instead of W: {sorted(parked & gemm_weights)}"
    assert len(work.closures) >= len(gemm_weights)

    accumulations: dict[str, int] = {}
    for n, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=n: accumulations.__setitem__(n, accumulations.get(n, 0) + 1))
    work.run()
    assert set(accumulations) == set(expected) and set(accumulations.values()) == {1}
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], rtol=1e-5, atol=1e-6, msg=n)
    with pytest.raises(RuntimeError, match="W step ran twice"):
        work.run()


def test_outside_a_b_step_split_ops_give_their_weight_gradient_at_once():
    model = build({})
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    loss_of(model, tokens).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    with weight_grad.split_backward():
        loss_of(model, tokens).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], rtol=1e-5, atol=1e-6, msg=n)


def test_w_hands_each_gradient_to_grad_without_a_copy_and_runs_the_hooks_once(monkeypatch):
    """W gives ``AccumulateGrad`` the gradient its GEMM made (no clone: ``weight_grad._HandOver``), then adds the
    next micro batch's into that same ``.grad`` in place; the post-accumulate hook (the data-parallel buffer's)
    sees each W once, and the sum is a plain backward's."""
    weight = torch.nn.Parameter(torch.randn(16, 8, generator=torch.Generator().manual_seed(2)))
    bias = torch.nn.Parameter(torch.zeros(16))
    inputs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(3 + i)) for i in range(2)]
    made, seen = [], []
    compute = weight_grad._LinearOp.weight_grad

    def recording(*args):
        dw, db = compute(*args)
        made.append(dw.data_ptr())
        return dw, db

    monkeypatch.setattr(weight_grad._LinearOp, "weight_grad", staticmethod(recording))

    def hook(param: torch.Tensor) -> None:
        if param.grad is not None:  # a B step's AccumulateGrad also calls it, with no gradient
            seen.append(param.grad.data_ptr())

    weight.register_post_accumulate_grad_hook(hook)
    for x in inputs:
        with weight_grad.split_backward():
            y = weight_grad.linear(x, weight, bias, "mkl")
            with weight_grad.deferring_weight_grads([weight, bias]) as work:
                y.square().sum().backward()
        work.run()
    assert seen == [made[0], made[0]], "W copied the weight gradient, or its hook ran other than once per W"
    expected = sum(torch.autograd.grad(torch.nn.functional.linear(x, weight, bias).square().sum(), weight)[0]
                   for x in inputs)
    torch.testing.assert_close(weight.grad, expected)
