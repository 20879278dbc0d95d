"""Training on CUDA.

* A few bf16 steps of the tiny GPT and the Llama-style model with the fused kernels (CUDA twins) and without them
  (``MEGATRON_LIKE_NO_CSRC=1`` and the ``--no-*-fusion`` flags): the same losses and gradient norms within bf16
  tolerance. Both runs start from the same weights and data. This checks the twins inside the model; a kernel
  error that Adam's normalization hides (a gradient scaled by a constant) is test_cuda_kernels.py's to catch.
* ``--optimizer-cpu-offload``: the optimizer steps on host copies of the device gradient shards (a path only a
  GPU takes) and trains like the optimizer on the device, within float32 tolerance.
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
    "gpt": {"scaled_upper_triang_masked_softmax", "bias_gelu", "vocab_cross_entropy"},  # its LayerNorm is torch's
    "llama": {"rms_norm", "swiglu", "rotary", "scaled_upper_triang_masked_softmax", "vocab_cross_entropy"},
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


def test_optimizer_cpu_offload_trains_like_the_device_optimizer():
    flags = ["--train-iters", "4", "--zero-stage", "1"]
    on_device = train_gpt(0, 1, flags)
    offloaded = train_gpt(0, 1, flags + ["--optimizer-cpu-offload"])
    torch.testing.assert_close(torch.tensor(offloaded["losses"]), torch.tensor(on_device["losses"]), rtol=1e-5, atol=0)
    for name, weight in on_device["params"].items():
        assert weight.is_cuda and offloaded["params"][name].is_cuda
        torch.testing.assert_close(offloaded["params"][name], weight, rtol=1e-5, atol=1e-5,
                                   msg=lambda m, n=name: f"{n}: {m}")
