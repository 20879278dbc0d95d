"""A MixtralForCausalLM converted by tools/convert_hf.py (to tp2 x pp2, expert parallelism 1) generates through
tools/generate.py (one process, KV cache) the same greedy tokens as transformers' ``generate``."""

from __future__ import annotations

import json

import pytest
import torch

from tests.e2e.test_tools_inference import run_tool
from tests.unit.test_hf_mixtral import convert_hf, tiny_mixtral

transformers = pytest.importorskip("transformers")
PROMPTS = ["3 14 15 92 65", "35 89", "7 7 7"]


def test_converted_mixtral_generates_like_transformers(tmp_path):
    hf = tiny_mixtral()
    hf.save_pretrained(tmp_path / "hf")
    ours = str(tmp_path / "ours")
    convert_hf.main(["from-hf", "--load", str(tmp_path / "hf"), "--save", ours, "--tensor-model-parallel-size", "2",
                     "--pipeline-model-parallel-size", "2"])
    flags = ["--load", ours, "--max-new-tokens", "12", "--greedy", "--json"]
    for p in PROMPTS:
        flags += ["--prompt-ids", p]
    ours_tokens = [json.loads(line)["token_ids"] for line in run_tool("generate.py", *flags).stdout.splitlines()]
    expected = []
    for p in PROMPTS:
        ids = torch.tensor([[int(t) for t in p.split()]])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
        expected.append(out[0, ids.shape[1]:].tolist())
    assert ours_tokens == expected
