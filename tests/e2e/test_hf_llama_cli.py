"""A LlamaForCausalLM, a MixtralForCausalLM, a Qwen3MoeForCausalLM and a DeepseekV3ForCausalLM (expert parallelism 1)
converted by tools/convert_hf.py (to tp2 x pp2) generate through tools/generate.py (one process, KV cache; MLA's
latent cache) the same greedy tokens as transformers' ``generate`` (Llama generation under tp is
tests/distributed/test_generation_tp.py's; the conversion runs in-process, as tests/unit/test_hf_llama.py's, to spare
a subprocess)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.e2e.test_tools_inference import run_tool
from tests.unit.test_hf_deepseek_v3 import tiny_deepseek
from tests.unit.test_hf_llama import convert_hf, tiny
from tests.unit.test_hf_mixtral import tiny_mixtral
from tests.unit.test_hf_qwen3 import tiny_qwen3

PROMPTS = ["3 14 15 92 65", "35 89", "7 7 7"]
TINY_MODELS = {"llama": lambda: tiny("llama"), "mixtral": tiny_mixtral, "qwen3_moe": lambda: tiny_qwen3(moe=True),
               "deepseek_v3": tiny_deepseek}


@pytest.mark.parametrize("family", sorted(TINY_MODELS))
def test_converted_model_generates_like_transformers(tmp_path, family):
    hf = TINY_MODELS[family]()
    hf.save_pretrained(tmp_path / "hf")
    ours = str(tmp_path / "ours")
    convert_hf.main(["from-hf", "--load", str(tmp_path / "hf"), "--save", ours, "--tensor-model-parallel-size", "2",
                     "--pipeline-model-parallel-size", "2"])
    flags = ["--load", ours, "--max-new-tokens", "12", "--greedy", "--json"]
    for p in PROMPTS:
        flags += ["--prompt-ids", p]
    single = [json.loads(line)["token_ids"] for line in run_tool("generate.py", *flags).stdout.splitlines()]
    expected = []
    for p in PROMPTS:
        ids = torch.tensor([[int(t) for t in p.split()]])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
        expected.append(out[0, ids.shape[1]:].tolist())
    assert single == expected
