"""A few bf16 training steps of the tiny GPT and the Llama-style model on CUDA, with the fused kernels (CUDA twins)
and without them (``MEGATRON_LIKE_NO_CSRC=1`` and the ``--no-*-fusion`` flags): the same losses and gradient norms
within bf16 tolerance. Both runs start from the same weights and data, so iteration 1's gradient norm compares the
fused backward passes directly; a wrong kernel moves it by far more than bf16 rounding does.
"""

from __future__ import annotations

import pytest
import torch

from megatron_like.kernels import _loader
from tests.distributed.gpt_runs import train_gpt

LOCAL_ATTENTION = ["--attention-backend", "local"]  # the fused softmax runs in the written-out attention core
MODELS = {
    "gpt": LOCAL_ATTENTION,
    "llama": LOCAL_ATTENTION + ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
                                "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
                                "--rotary-percent", "0.5"],
}
TWINS = {
    "gpt": {"scaled_upper_triang_masked_softmax"},  # its LayerNorm is torch's; bias-GELU has no CUDA twin
    "llama": {"rms_norm", "swiglu", "rotary", "scaled_upper_triang_masked_softmax"},
}
"""The CUDA twins each model must run when fused."""
UNFUSED = ["--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-cross-entropy-loss-fusion"]
RUN = ["--bf16", "--train-iters", "4", "--lr", "3e-3"]


@pytest.mark.parametrize("model", sorted(MODELS))
def test_bf16_training_is_the_same_with_and_without_fused_kernels(model, monkeypatch, twins_used):
    fused = train_gpt(0, 1, RUN + MODELS[model])
    assert {_loader.CUDA_MODULE_PREFIX + op for op in TWINS[model]} <= twins_used
    monkeypatch.setenv(_loader.NO_CSRC_ENV, "1")
    plain = train_gpt(0, 1, RUN + MODELS[model] + UNFUSED)
    assert len(fused["losses"]) == len(plain["losses"]) == 4
    torch.testing.assert_close(torch.tensor(fused["losses"]), torch.tensor(plain["losses"]), rtol=1e-2, atol=0)
    torch.testing.assert_close(torch.tensor(fused["grad_norms"]), torch.tensor(plain["grad_norms"]), rtol=3e-2,
                               atol=0)
    assert fused["losses"][-1] < fused["losses"][0]  # it trains
