"""Generation under tensor and pipeline parallelism equals one process: greedy, seeded sampling and beam
search on a left-padded batch, from one checkpoint loaded into each layout."""

from __future__ import annotations

import functools
import os

import pytest
import torch

from megatron_like.config import ParallelConfig
from megatron_like.inference import GenerationParams, generate, load_inference_model, serving
from megatron_like.model import GPTModel
from megatron_like.model.state import gather_full_state
from megatron_like.parallel_state import ParallelState
from tests.distributed.harness import run_distributed
from tests.unit.test_generation_state import make_config, write_checkpoint

PROMPTS = [[1, 2, 3, 4, 5, 6], [7, 8], [9, 10, 11]]
EOD = 13
RUNS = {
    "greedy": GenerationParams(max_new_tokens=10),
    "sample": GenerationParams(max_new_tokens=10, do_sample=True, top_k=30, top_p=0.95, temperature=0.9, seed=5,
                               num_return_sequences=2),
    "beam": GenerationParams(max_new_tokens=8, num_beams=3, num_return_sequences=2),
    "unseeded": GenerationParams(max_new_tokens=10, do_sample=True),  # ranks must agree on a seed
}


def run_all(ps: ParallelState, checkpoint: str) -> dict[str, list[list[list[int]]]]:
    loaded = load_inference_model(checkpoint, ps)
    return {name: [[g.token_ids for g in seqs] for seqs in
                   generate(loaded.model, PROMPTS, params, eod=EOD, vocab_size=loaded.vocab_size)]
            for name, params in RUNS.items()}


def parallel_worker(rank: int, world_size: int, tp: int, pp: int, checkpoints: list[str]) -> list[dict]:
    """``run_all`` of each checkpoint in turn at tp x pp, in one process group (spawning costs more than a run)."""
    torch.set_num_threads(1)
    ps = ParallelState.initialize(ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp))
    return [run_all(ps, checkpoint) for checkpoint in checkpoints]


LLAMA = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, group_query_attention=True,
             num_query_groups=2, disable_bias_linear=True, untie_embeddings_and_output_weights=True,
             window_size="4,0", use_rope_scaling=True, rope_scaling_original_max_position_embeddings=16)
"""A Llama-style model: each tp=2 rank caches one key/value head for its two query heads; a sliding window of 5
keys (the prompts plus 10 new tokens run past it) and Llama 3.1's RoPE scaling."""
QWEN3 = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, group_query_attention=True,
             num_query_groups=2, disable_bias_linear=True, untie_embeddings_and_output_weights=True,
             qk_layernorm=True, kv_channels=16)
"""The Llama-style model with Qwen3's QK-norm (weights drawn around 1) and heads of 16 features: each tp=2 rank
normalizes its own query and key heads, the cached keys normalized and rotated once."""
MLA = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, disable_bias_linear=True,
           untie_embeddings_and_output_weights=True, multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=8,
           qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6, rope_type="yarn", rotary_scaling_factor=4.0,
           original_max_position_embeddings=8)
"""Multi-latent attention with YaRN: each tp=2 rank caches the whole latent and decodes its two heads from it."""
FAMILIES = {"gpt": {}, "llama": LLAMA, "qwen3": QWEN3, "mla": MLA}


@functools.cache
def checkpoint_and_reference(tmp: str, family: str = "gpt") -> tuple[str, dict]:
    """A tp=2 checkpoint of a model with a large init (so tokens depend on attention) and its tp=1 outputs."""
    config = make_config(tp=2, pp=1)
    config.model.init_method_std = 0.3
    for name, value in FAMILIES[family].items():
        setattr(config.model, name, value)
    ps = ParallelState.single_process(torch.device("cpu"))
    model = GPTModel(config.model, ps, vocab_size=104, seed=2)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_layernorm.weight", "k_layernorm.weight")):
                param.normal_(1.0, 0.5, generator=generator)
    write_checkpoint(tmp, config, gather_full_state([model]), config.padded_vocab_size(100))
    torch.set_num_threads(1)
    return tmp, run_all(ps, tmp)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return checkpoint_and_reference(str(tmp_path_factory.mktemp("gen_ckpt")))


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory):
    return checkpoint_and_reference(str(tmp_path_factory.mktemp("gen_llama_ckpt")), "llama")


@pytest.fixture(scope="module")
def saved_qwen3(tmp_path_factory):
    return checkpoint_and_reference(str(tmp_path_factory.mktemp("gen_qwen3_ckpt")), "qwen3")


@pytest.fixture(scope="module")
def saved_mla(tmp_path_factory):
    return checkpoint_and_reference(str(tmp_path_factory.mktemp("gen_mla_ckpt")), "mla")


TP2_FAMILIES = ["saved", "saved_llama", "saved_qwen3", "saved_mla"]


@pytest.fixture(scope="module")
def tp2_generations(request) -> dict[str, list[dict]]:
    """Every family's checkpoint generated from at tp 2 in one process group: ``{fixture: each rank's runs}``."""
    checkpoints = [request.getfixturevalue(fixture)[0] for fixture in TP2_FAMILIES]
    per_rank = run_distributed(parallel_worker, 2, 2, 1, checkpoints, timeout=240)
    return {fixture: [rank_results[i] for rank_results in per_rank] for i, fixture in enumerate(TP2_FAMILIES)}


@pytest.mark.parametrize("tp,pp,fixture",
                         [(2, 1, "saved"), (1, 2, "saved"), (2, 1, "saved_llama"), (2, 1, "saved_qwen3"),
                          (2, 1, "saved_mla")],
                         ids=["tp2", "pp2", "tp2-llama", "tp2-qwen3", "tp2-mla"])
def test_parallel_generation_equals_single_process(request, tp, pp, fixture):
    checkpoint, reference = request.getfixturevalue(fixture)
    if tp == 2:
        results = request.getfixturevalue("tp2_generations")[fixture]
    else:
        results = [runs[0] for runs in run_distributed(parallel_worker, tp * pp, tp, pp, [checkpoint], timeout=120)]
    for rank_result in results:  # every rank holds the same answer, the single process's when seeded
        assert rank_result == results[0]
        assert {k: v for k, v in rank_result.items() if k != "unseeded"} == \
            {k: v for k, v in reference.items() if k != "unseeded"}


# ------------------------------------------------------------------ Mixtral with its experts split over ep ranks
MIXTRAL_PROMPTS = [[3, 14, 15, 92, 65], [35, 89], [7, 7, 7]]


def mixtral_ep_worker(rank: int, world_size: int, converted: str, torch_ep2: str) -> dict:
    """ep2 x tp2: re-save the converted Mixtral in the torch format at ep2 (tools/checkpoint_reshard.py's pass: a
    file per (tp, ep) rank, each with its 2 of the 4 experts), load that into the same layout, and generate."""
    import sys

    from megatron_like import collectives as comm
    from megatron_like.model.state import read_saved_config

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
    import checkpoint_reshard as reshard

    torch.set_num_threads(1)
    saved = read_saved_config(converted)
    target = reshard.layout_config(saved, 2, 1, None, 2, 0, False, ep=2)
    reshard.convert(target, converted, torch_ep2, "torch", target.padded_vocab_size(saved.model.vocab_size),
                    with_optimizer=False)
    ps = ParallelState.initialize(ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2), 4)
    loaded = load_inference_model(torch_ep2, ps)
    assert loaded.config.parallel.expert_model_parallel_size == 2
    assert loaded.model[0].layers[0].mlp.experts.weight1.shape[0] == 2  # this rank's half of the experts
    with torch.no_grad():
        ids = torch.tensor([MIXTRAL_PROMPTS[0]])
        logits = comm.all_gather_along_dim(loaded.model[0](ids, None), ps.tp_group, dim=-1)[..., :loaded.vocab_size]
    runs = {"greedy": GenerationParams(max_new_tokens=12),
            "unseeded": GenerationParams(max_new_tokens=8, do_sample=True)}  # the ep ranks must agree on a seed
    tokens = {name: [[g.token_ids for g in seqs] for seqs in generate(loaded.model, MIXTRAL_PROMPTS, params,
                                                                       vocab_size=loaded.vocab_size)]
              for name, params in runs.items()}
    # The server's path (tools/text_generation_server.py): rank 0's request broadcast to the ep x tp ranks,
    # every rank serving it in lockstep.
    served = []
    for request in ({"ids": MIXTRAL_PROMPTS, "params": {"max_new_tokens": 12}},
                    {"ids": MIXTRAL_PROMPTS[:1], "params": {"max_new_tokens": 8, "do_sample": True}}):
        outcome = serving.serve_request(loaded, serving.broadcast_request(request if rank == 0 else None, ps.device),
                                        ps.device)
        served.append((outcome.status, [[g.token_ids for g in seqs] for seqs in outcome.results or []]))
    # Evaluation at ep2 inside dp4 (tp1): two replicas of two ep ranks each split the windows.
    ps = ParallelState.initialize(ParallelConfig(expert_model_parallel_size=2), 4)
    chunk = load_inference_model(converted, ps).model[0]
    return {"logits": logits, "tokens": tokens, "served": served, "perplexity": mixtral_perplexity(chunk)}


def mixtral_perplexity(chunk) -> float:
    from megatron_like.inference.evaluation import perplexity

    stream = [(7 * i + 3) % 120 for i in range(90)]
    return perplexity(chunk, stream, 30, seq_length=16, stride=8, vocab_size=120, batch_size=2).avg_loss


def test_mixtral_converted_at_ep2_generates_like_transformers_and_converts_back(tmp_path):
    """HF Mixtral -> ours recorded at ep2 x tp2 (tools/convert_hf.py) -> torch format at ep2 (a file per ep rank)
    -> generation at ep2 x tp2 (4 processes) and the server's lockstep serving there: the logits and greedy tokens
    of transformers; evaluation at ep2 in
    dp4 equals one process's; and that torch-format ep2 checkpoint converts back to the published tensors."""
    from megatron_like.inference import hf_gpt2
    from tests.unit.test_hf_llama import convert_hf
    from tests.unit.test_hf_mixtral import tiny_mixtral

    hf = tiny_mixtral()
    hf.save_pretrained(tmp_path / "hf")
    converted, torch_ep2, back = (str(tmp_path / name) for name in ("ours", "torch_ep2", "back"))
    convert_hf.main(["from-hf", "--load", str(tmp_path / "hf"), "--save", converted,
                     "--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2"])
    results = run_distributed(mixtral_ep_worker, 4, converted, torch_ep2, timeout=300)
    assert sorted(os.listdir(tmp_path / "torch_ep2" / "iter_0000000")) == [
        "mp_rank_00_000_000", "mp_rank_00_000_001", "mp_rank_01_000_000", "mp_rank_01_000_001"]
    expected_tokens = []
    with torch.no_grad():
        expected_logits = hf(torch.tensor([MIXTRAL_PROMPTS[0]])).logits
        for prompt in MIXTRAL_PROMPTS:
            ids = torch.tensor([prompt])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
            expected_tokens.append([out[0, ids.shape[1]:].tolist()])
    single = load_inference_model(converted, ParallelState.single_process(torch.device("cpu"))).model[0]
    for result in results:
        torch.testing.assert_close(result["perplexity"], mixtral_perplexity(single), rtol=1e-5, atol=0)
        torch.testing.assert_close(result["logits"], expected_logits, rtol=5e-5, atol=5e-5)
        assert result["tokens"]["greedy"] == expected_tokens
        assert result["tokens"] == results[0]["tokens"]
        assert result["served"][0] == (200, expected_tokens)  # served greedy = transformers' greedy
        assert result["served"] == results[0]["served"] and result["served"][1][0] == 200
    convert_hf.main(["to-hf", "--load", torch_ep2, "--save", back])
    _, original = hf_gpt2.read_hf_dir(str(tmp_path / "hf"))
    _, converted_back = hf_gpt2.read_hf_dir(back)
    assert sorted(converted_back) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(converted_back[name], tensor), name


def test_inference_tools_count_the_expert_parallel_ranks_in_one_model_replica():
    from megatron_like.config import Config, ConfigError
    from megatron_like.inference import cli

    config = Config()
    config.parallel.tensor_model_parallel_size, config.parallel.expert_model_parallel_size = 2, 2
    config.world_size = 2
    with pytest.raises(ConfigError) as error:  # before any process group
        cli.setup(config)
    assert str(error.value) == ("this tool runs one model replica: launch --tensor-model-parallel-size 2 x --pipeline-"
                                "model-parallel-size 1 x --expert-model-parallel-size 2 = 4 processes, not 2")
    config.world_size = 6
    with pytest.raises(ConfigError, match="the world size 6 is not a multiple of .* = 4"):
        cli.setup(config, data_parallel=True)
