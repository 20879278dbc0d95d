"""Generation under tensor and pipeline parallelism equals one process: greedy, seeded sampling and beam
search on a left-padded batch, from one checkpoint loaded into each layout."""

from __future__ import annotations

import functools

import pytest
import torch

from megatron_like.config import ParallelConfig
from megatron_like.inference import GenerationParams, generate, load_inference_model
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


def parallel_worker(rank: int, world_size: int, tp: int, pp: int, checkpoint: str) -> dict:
    torch.set_num_threads(1)
    ps = ParallelState.initialize(ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp))
    return run_all(ps, checkpoint)


LLAMA = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, group_query_attention=True,
             num_query_groups=2, disable_bias_linear=True, untie_embeddings_and_output_weights=True)
"""A Llama-style model: each tp=2 rank caches one key/value head for its two query heads."""


@functools.cache
def checkpoint_and_reference(tmp: str, llama: bool = False) -> tuple[str, dict]:
    """A tp=2 checkpoint of a model with a large init (so tokens depend on attention) and its tp=1 outputs."""
    config = make_config(tp=2, pp=1)
    config.model.init_method_std = 0.3
    if llama:
        for name, value in LLAMA.items():
            setattr(config.model, name, value)
    ps = ParallelState.single_process(torch.device("cpu"))
    model = GPTModel(config.model, ps, vocab_size=104, seed=2)
    write_checkpoint(tmp, config, gather_full_state([model]), config.padded_vocab_size(100))
    torch.set_num_threads(1)
    return tmp, run_all(ps, tmp)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return checkpoint_and_reference(str(tmp_path_factory.mktemp("gen_ckpt")))


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory):
    return checkpoint_and_reference(str(tmp_path_factory.mktemp("gen_llama_ckpt")), llama=True)


@pytest.mark.parametrize("tp,pp,llama", [(2, 1, False), (1, 2, False), (2, 1, True)], ids=["tp2", "pp2", "tp2-llama"])
def test_parallel_generation_equals_single_process(request, tp, pp, llama):
    checkpoint, reference = request.getfixturevalue("saved_llama" if llama else "saved")
    results = run_distributed(parallel_worker, tp * pp, tp, pp, checkpoint, timeout=120)
    for rank_result in results:  # every rank holds the same answer, the single process's when seeded
        assert rank_result == results[0]
        assert {k: v for k, v in rank_result.items() if k != "unseeded"} == \
            {k: v for k, v in reference.items() if k != "unseeded"}
