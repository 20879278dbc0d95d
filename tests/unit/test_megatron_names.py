"""Our checkpoints <-> Megatron-LM's (megatron_like/model/megatron_names.py, training/megatron_format.py,
tools/convert_megatron.py), without Megatron-LM installed.

The key lists and shapes below are what megatron-core 0.16.1's ``GPTModel.sharded_state_dict`` produces, read from
its code (``transformer/transformer_block.py`` ``TransformerBlock.sharded_state_dict``: uniform layers stacked under
``decoder.layers.`` with a ``(0, layer, num_layers)`` offset, per-layer keys when ``moe_layer_freq`` is > 1 or a
list; ``transformer/mlp.py`` ``apply_swiglu_sharded_factory``: tp rank r's ``[gate_r; up_r]`` goes to chunks r and
tp + r of 2 tp; ``transformer/moe/experts.py``: GroupedMLP's ``weight1.view(E_local, h, -1)``, SequentialMLP's and
GroupedMLP's common key ``experts.experts.linear_fc1.weight`` with an expert axis; ``transformer/utils.py``
``_get_extra_state_offsets``; ``dist_checkpointing/core.py`` ``CheckpointingConfig``), for tiny models of each
architecture: L 2, h 16, 4 heads in 2 query groups (head dim 4), vocabulary 60 padded to 64.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys

import pytest
import torch
import torch.nn.functional as F

from megatron_like.config import Config, ModelConfig
from megatron_like.inference.hf_llama import _qkv_to_hf
from megatron_like.model import megatron_names as names
from megatron_like.model.gpt import GPTModel
from megatron_like.model.state import gather_full_state, load_full_state
from megatron_like.parallel_state import ParallelState
from megatron_like.training import megatron_format as mf
from megatron_like.training.dist_checkpointing import read_full_tensors, save_full_state

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import convert_megatron  # noqa: E402

BASE = dict(num_layers=2, hidden_size=16, num_attention_heads=4, seq_length=16, max_position_embeddings=16,
            vocab_size=60, make_vocab_size_divisible_by=8, init_method_std=0.3)
LLAMA = dict(BASE, position_embedding_type="rope", normalization="RMSNorm", swiglu=True, group_query_attention=True,
             num_query_groups=2, disable_bias_linear=True, untie_embeddings_and_output_weights=True, ffn_hidden_size=32)
MODELS = {
    "gpt2": ModelConfig(**BASE),
    "llama": ModelConfig(**LLAMA),
    "mixtral": ModelConfig(**LLAMA, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=8),
    "qwen3": ModelConfig(**LLAMA, qk_layernorm=True, kv_channels=8),  # head dim 8 > hidden / heads
    "moe_every_2nd_shared": ModelConfig(**LLAMA, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=8,
                                        moe_layer_freq="2", moe_shared_expert_intermediate_size=8),
}
# DeepSeek-V3-shaped: MLA (q latent 8, kv latent 8, 4 heads of 4 + rope 4, values 4), a dense first layer then MoE
# with a shared expert, sigmoid routing with the expert bias, one MTP depth
_MLA = dict({k: v for k, v in LLAMA.items() if k not in ("group_query_attention", "num_query_groups")},
            multi_latent_attention=True, q_lora_rank=8, kv_lora_rank=8, qk_head_dim=4, qk_pos_emb_head_dim=4,
            v_head_dim=4, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=8, moe_layer_freq="[0,1]",
            moe_shared_expert_intermediate_size=8, moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True)
MODELS["deepseek_v3"] = ModelConfig(**_MLA, mtp_num_layers=1)
MODELS["deepseek_v3_no_mtp"] = ModelConfig(**_MLA)


def _deepseek_v3_keys(spec: str) -> dict[str, tuple[int, ...]]:
    """megatron-core 0.16.1's torch_dist keys of the DeepSeek-V3-shaped model (``models/gpt/gpt_layer_specs.py``
    ``multi_latent_attention`` branches: a separate ``input_layernorm``, no ``sharded_state_dict_keys_map``;
    ``transformer/multi_latent_attention.py``; ``transformer/moe/router.py``'s persistent ``expert_bias``;
    ``transformer/multi_token_prediction.py``: ``mtp.layers.<d>.{enorm,hnorm,eh_proj,transformer_layer,
    final_layernorm}``). Per-layer keys: ``moe_layer_freq`` is a list."""
    te = spec == "te"
    attention = {  # the latents' norms: q_layernorm / kv_layernorm (local), fused into the up-projections (TE)
        "input_layernorm.weight": (16,), "self_attention.linear_q_down_proj.weight": (8, 16),
        ("self_attention.linear_q_up_proj.layer_norm_weight" if te else "self_attention.q_layernorm.weight"): (8,),
        "self_attention.linear_q_up_proj.weight": (32, 8), "self_attention.linear_kv_down_proj.weight": (12, 16),
        ("self_attention.linear_kv_up_proj.layer_norm_weight" if te else "self_attention.kv_layernorm.weight"): (8,),
        "self_attention.linear_kv_up_proj.weight": (32, 8), "self_attention.linear_proj.weight": (16, 16)}
    dense = attention | {("mlp.linear_fc1.layer_norm_weight" if te else "pre_mlp_layernorm.weight"): (16,),
                         "mlp.linear_fc1.weight": (64, 16), "mlp.linear_fc2.weight": (16, 32)}
    moe = attention | {
        "pre_mlp_layernorm.weight": (16,), "mlp.router.weight": (4, 16), "mlp.router.expert_bias": (4,),
        "mlp.experts.experts.linear_fc1.weight": (4, 16, 16), "mlp.experts.experts.linear_fc2.weight": (4, 16, 8),
        "mlp.shared_experts.linear_fc1.weight": (16, 16), "mlp.shared_experts.linear_fc2.weight": (16, 8)}
    keys = {"embedding.word_embeddings.weight": (64, 16), "decoder.final_layernorm.weight": (16,),
            "output_layer.weight": (64, 16), "mtp.layers.0.enorm.weight": (16,), "mtp.layers.0.hnorm.weight": (16,),
            "mtp.layers.0.eh_proj.weight": (16, 32), "mtp.layers.0.final_layernorm.weight": (16,)}
    keys |= {f"decoder.layers.0.{k}": v for k, v in dense.items()} | {f"decoder.layers.1.{k}": v
                                                                     for k, v in moe.items()}
    return keys | {f"mtp.layers.0.transformer_layer.{k}": v for k, v in moe.items()}

# torch_dist keys and global shapes of megatron-core 0.16.1 (see the module docstring), per architecture and spec
EXPECTED = {
    ("gpt2", "local"): {
        "embedding.word_embeddings.weight": (64, 16), "embedding.position_embeddings.weight": (16, 16),
        # the local spec's sharded_state_dict_keys_map: its input_layernorm / pre_mlp_layernorm under TE's names
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (2, 16),
        "decoder.layers.self_attention.linear_qkv.layer_norm_bias": (2, 16),
        "decoder.layers.self_attention.linear_qkv.weight": (2, 48, 16),
        "decoder.layers.self_attention.linear_qkv.bias": (2, 48),
        "decoder.layers.self_attention.linear_proj.weight": (2, 16, 16),
        "decoder.layers.self_attention.linear_proj.bias": (2, 16),
        "decoder.layers.mlp.linear_fc1.layer_norm_weight": (2, 16),
        "decoder.layers.mlp.linear_fc1.layer_norm_bias": (2, 16),
        "decoder.layers.mlp.linear_fc1.weight": (2, 64, 16), "decoder.layers.mlp.linear_fc1.bias": (2, 64),
        "decoder.layers.mlp.linear_fc2.weight": (2, 16, 64), "decoder.layers.mlp.linear_fc2.bias": (2, 16),
        "decoder.final_layernorm.weight": (16,), "decoder.final_layernorm.bias": (16,),
    },
    ("llama", "te"): {
        "embedding.word_embeddings.weight": (64, 16),
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (2, 16),
        "decoder.layers.self_attention.linear_qkv.weight": (2, 32, 16),  # (4 + 2 * 2) heads of 4
        "decoder.layers.self_attention.linear_proj.weight": (2, 16, 16),
        "decoder.layers.mlp.linear_fc1.layer_norm_weight": (2, 16),
        "decoder.layers.mlp.linear_fc1.weight": (2, 64, 16),  # gate 32 rows, then up 32 rows
        "decoder.layers.mlp.linear_fc2.weight": (2, 16, 32),
        "decoder.final_layernorm.weight": (16,), "output_layer.weight": (64, 16),
    },
    ("qwen3", "te"): {
        "embedding.word_embeddings.weight": (64, 16),
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (2, 16),
        "decoder.layers.self_attention.linear_qkv.weight": (2, 64, 16),  # (4 + 2 * 2) heads of 8
        "decoder.layers.self_attention.q_layernorm.weight": (2, 8),
        "decoder.layers.self_attention.k_layernorm.weight": (2, 8),
        "decoder.layers.self_attention.linear_proj.weight": (2, 16, 32),
        "decoder.layers.mlp.linear_fc1.layer_norm_weight": (2, 16),
        "decoder.layers.mlp.linear_fc1.weight": (2, 64, 16),
        "decoder.layers.mlp.linear_fc2.weight": (2, 16, 32),
        "decoder.final_layernorm.weight": (16,), "output_layer.weight": (64, 16),
    },
    ("mixtral", "local"): {
        "embedding.word_embeddings.weight": (64, 16),
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (2, 16),
        "decoder.layers.self_attention.linear_qkv.weight": (2, 32, 16),
        "decoder.layers.self_attention.linear_proj.weight": (2, 16, 16),
        "decoder.layers.mlp.linear_fc1.layer_norm_weight": (2, 16),  # the local spec maps it for MoE layers too
        "decoder.layers.mlp.router.weight": (2, 4, 16),
        "decoder.layers.mlp.experts.experts.linear_fc1.weight": (2, 4, 16, 16),  # [L, E, 2 F, h]
        "decoder.layers.mlp.experts.experts.linear_fc2.weight": (2, 4, 16, 8),  # [L, E, h, F]
        "decoder.final_layernorm.weight": (16,), "output_layer.weight": (64, 16),
    },
    ("moe_every_2nd_shared", "te"): {  # moe_layer_freq 2: per-layer keys; layer 0 MoE (its norm apart), 1 dense
        "embedding.word_embeddings.weight": (64, 16),
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight": (16,),
        "decoder.layers.0.self_attention.linear_qkv.weight": (32, 16),
        "decoder.layers.0.self_attention.linear_proj.weight": (16, 16),
        "decoder.layers.0.pre_mlp_layernorm.weight": (16,),
        "decoder.layers.0.mlp.router.weight": (4, 16),
        "decoder.layers.0.mlp.experts.experts.linear_fc1.weight": (4, 16, 16),
        "decoder.layers.0.mlp.experts.experts.linear_fc2.weight": (4, 16, 8),
        "decoder.layers.0.mlp.shared_experts.linear_fc1.weight": (16, 16),
        "decoder.layers.0.mlp.shared_experts.linear_fc2.weight": (16, 8),
        "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight": (16,),
        "decoder.layers.1.self_attention.linear_qkv.weight": (32, 16),
        "decoder.layers.1.self_attention.linear_proj.weight": (16, 16),
        "decoder.layers.1.mlp.linear_fc1.layer_norm_weight": (16,),
        "decoder.layers.1.mlp.linear_fc1.weight": (64, 16),
        "decoder.layers.1.mlp.linear_fc2.weight": (16, 32),
        "decoder.final_layernorm.weight": (16,), "output_layer.weight": (64, 16),
    },
}


def full_state_of(kind: str) -> dict[str, torch.Tensor]:
    """The single-process full state of a tiny model of ``kind`` (random weights, biases and norms included)."""
    model = GPTModel(MODELS[kind], ParallelState.single_process(torch.device("cpu")), vocab_size=64, seed=0)
    full = gather_full_state([model])
    gen = torch.Generator().manual_seed(1)
    return {k: torch.randn(v.shape, generator=gen) for k, v in full.items()}  # norms and biases not constant


@pytest.mark.parametrize("kind, spec", list(EXPECTED))
def test_torch_dist_keys_and_shapes(kind, spec):
    got = names.to_megatron_global(full_state_of(kind), MODELS[kind], spec)
    assert {k: tuple(v.shape) for k, v in got.items()} == EXPECTED[kind, spec]


# The legacy files hold the modules' own state-dict names: per spec, the norms of a dense and of an MoE layer
LEGACY_NORMS = {
    ("local", "dense"): ("input_layernorm.weight", "pre_mlp_layernorm.weight"),
    ("local", "moe"): ("input_layernorm.weight", "pre_mlp_layernorm.weight"),
    ("te", "dense"): ("self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight"),
    ("te", "moe"): ("self_attention.linear_qkv.layer_norm_weight", "pre_mlp_layernorm.weight"),
}


@pytest.mark.parametrize("spec, layer_kind", list(LEGACY_NORMS))
def test_legacy_norm_names(spec, layer_kind):
    layer = 1 if layer_kind == "dense" else 0  # moe_every_2nd_shared: layer 0 MoE, layer 1 dense
    got = names.to_megatron_layers(full_state_of("moe_every_2nd_shared"), MODELS["moe_every_2nd_shared"], spec,
                                   sharded=False)
    norms = sorted(k[len(f"decoder.layers.{layer}."):] for k in got
                   if k.startswith(f"decoder.layers.{layer}.") and "norm" in k)
    assert norms == sorted(LEGACY_NORMS[spec, layer_kind])


def test_extra_state_keys():
    keys = mf.extra_state_keys(MODELS["llama"], "te")
    assert "decoder.layers.self_attention.linear_qkv._extra_state/shard_1_2" in keys
    assert "decoder.layers.self_attention.core_attention._extra_state/shard_0_2" in keys
    assert "output_layer._extra_state/shard_0_1" in keys
    per_layer = mf.extra_state_keys(MODELS["moe_every_2nd_shared"], "local")
    assert "decoder.layers.1.mlp.linear_fc1._extra_state/shard_0_1" in per_layer
    assert "decoder.layers.0.mlp.shared_experts.linear_fc1._extra_state/shard_0_1" in per_layer
    assert not any("core_attention" in k for k in per_layer)  # the local spec's attention core has none
    assert "output_layer._extra_state/shard_0_1" in mf.extra_state_keys(MODELS["gpt2"], "local")  # tied too


def test_qkv_rows_follow_megatron_core_split():
    """Megatron-core's SelfAttention views linear_qkv's output as [groups, (heads/groups + 2) * hd] and splits it
    [heads/groups * hd, hd, hd]: the same q, k, v as our HF converter takes from our rows."""
    full = full_state_of("llama")
    mega = names.to_megatron_layers(full, MODELS["llama"], sharded=True)
    qkv = mega["decoder.layers.0.self_attention.linear_qkv.weight"]
    per_group = qkv.reshape(2, (2 + 2) * 4, 16)
    q, k, v = (t.reshape(-1, 16) for t in per_group.split([2 * 4, 4, 4], dim=1))
    for mine, theirs in zip(_qkv_to_hf(full["layers.0.attention.qkv.weight"], 4, 2), (q, k, v)):
        assert torch.equal(mine, theirs)


def test_swiglu_gate_up_order_gives_our_mlp_output():
    """Megatron-core's SwiGLU: silu(first half of fc1's output) * second half; from the converted weights it
    equals our MLP's output (ours interleaves gate and up rows)."""
    model = GPTModel(MODELS["llama"], ParallelState.single_process(torch.device("cpu")), vocab_size=64, seed=0)
    mlp = model.layers[0].mlp
    mega = names.to_megatron_layers(gather_full_state([model]), MODELS["llama"], sharded=True)
    fc1, fc2 = mega["decoder.layers.0.mlp.linear_fc1.weight"], mega["decoder.layers.0.mlp.linear_fc2.weight"]
    x = torch.randn(5, 1, 16, generator=torch.Generator().manual_seed(2))
    gate, up = (x @ fc1.T).chunk(2, dim=-1)
    with torch.no_grad():
        torch.testing.assert_close(mlp(x), (F.silu(gate) * up) @ fc2.T, rtol=1e-5, atol=1e-6)


def test_expert_layout_matches_grouped_mlp_and_sequential_mlp():
    """Each expert's Megatron-core fc1 [2F, h] computes our expert's SwiGLU; GroupedMLP's legacy weight1 viewed as
    [E_local, h, -1] (its forward) is that fc1 transposed, at tp 2 per rank."""
    full = full_state_of("mixtral")
    mega = names.to_megatron_layers(full, MODELS["mixtral"], sharded=True)
    fc1 = mega["decoder.layers.0." + names.EXPERT_FC1]
    fc2 = mega["decoder.layers.0." + names.EXPERT_FC2]
    ours1, ours2 = full["layers.0.mlp.experts.weight1"], full["layers.0.mlp.experts.weight2"]
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(4))
    for e in range(4):
        pairs = (x @ ours1[e]).reshape(3, -1, 2)  # ours: columns interleaved (gate, up)
        gate, up = (x @ fc1[e].T).chunk(2, dim=-1)
        torch.testing.assert_close((F.silu(gate) * up) @ fc2[e].T, (F.silu(pairs[..., 0]) * pairs[..., 1]) @ ours2[e])
    config = Config()
    config.model = MODELS["mixtral"]
    for rank in range(2):
        state = mf.legacy_rank_state(mega, config, tp=2, tp_rank=rank, pp=1, pp_rank=0, ep=1, ep_rank=0, spec="local",
                                     experts="grouped")
        w1 = state["decoder.layers.0.mlp.experts.weight1"].view(4, 16, -1)
        for e in range(4):
            assert torch.equal(w1[e].T, names.split_tp_megatron(names.EXPERT_FC1, fc1, MODELS["mixtral"], 2, rank)[e])


def test_swiglu_tp_shards_land_where_megatron_core_puts_them():
    """apply_swiglu_sharded_factory: rank r's [gate_r; up_r] halves are chunks r and tp + r of the global fc1."""
    fc1 = torch.arange(8 * 3).reshape(8, 3)
    for tp in (1, 2, 4):
        chunks = fc1.chunk(2 * tp)
        for r in range(tp):
            gate, up = names.split_tp_megatron("mlp.linear_fc1.weight", fc1, MODELS["llama"], tp, r).chunk(2)
            assert torch.equal(gate, chunks[r]) and torch.equal(up, chunks[tp + r])
        shards = [names.split_tp_megatron("mlp.linear_fc1.weight", fc1, MODELS["llama"], tp, r) for r in range(tp)]
        assert torch.equal(names.merge_tp_megatron("mlp.linear_fc1.weight", shards, MODELS["llama"]), fc1)


def _save_ours(root, kind: str) -> dict[str, torch.Tensor]:
    config = Config()
    config.model = MODELS[kind]
    config.data.mock_data = True
    config.validate()
    full = full_state_of(kind)
    save_full_state(str(root), 7, config, {"model." + k: v for k, v in full.items()})
    return full


EXPECTED |= {("deepseek_v3", spec): _deepseek_v3_keys(spec) for spec in names.SPECS}


def test_mla_rope_rows_are_deepseeks_interleaved_pairs():
    """Megatron-core's MLA rotates ``cat(t[0::2], t[1::2])`` of each head's rope slice (``rope_utils.py``
    ``_apply_rotary_pos_emb_bshd`` with ``multi_latent_attention``): the converted rows, read that way, are ours."""
    full, model = full_state_of("deepseek_v3"), MODELS["deepseek_v3"]
    mega = names.to_megatron_layers(full, model, "local", sharded=True)
    for ours, theirs, heads in (("attention.q_up.weight", "self_attention.linear_q_up_proj.weight", 4),
                                ("attention.kv_down.weight", "self_attention.linear_kv_down_proj.weight", 1)):
        rope = mega[f"decoder.layers.0.{theirs}"].reshape(heads, -1, 8 if heads == 4 else 16)[:, -4:]
        read = torch.cat([rope[:, 0::2], rope[:, 1::2]], dim=1)
        assert not torch.equal(read, rope)  # 4 rope rows: the two orders differ
        assert torch.equal(read, full[f"layers.0.{ours}"].reshape(heads, -1, read.shape[-1])[:, -4:]), ours


def test_mla_down_projections_split_over_tp_in_the_local_spec_only():
    """Legacy files: ColumnParallelLinear (``gather_output=False``) in the local spec, TE's duplicated TELinear."""
    model, q_down = MODELS["deepseek_v3_no_mtp"], torch.arange(8.0 * 16).reshape(8, 16)
    name = "self_attention.linear_q_down_proj.weight"
    assert torch.equal(names.split_tp_megatron(name, q_down, model, 2, 1, "local"), q_down[4:])
    assert torch.equal(names.split_tp_megatron(name, q_down, model, 2, 1, "te"), q_down)


ROUND_TRIPS = [  # (model, Megatron format, layer spec, expert style, tp, pp, ep)
    ("gpt2", "torch", "local", "grouped", 2, 2, 1),  # tied embedding: the last stage's copy
    ("gpt2", "torch_dist", "local", "grouped", 1, 1, 1),
    ("llama", "torch", "te", "grouped", 2, 1, 1),
    ("llama", "torch_dist", "te", "grouped", 2, 2, 1),
    ("qwen3", "torch", "te", "grouped", 2, 1, 1),
    ("qwen3", "torch_dist", "te", "grouped", 1, 1, 1),
    ("mixtral", "torch", "local", "grouped", 2, 2, 2),
    ("mixtral", "torch", "te", "sequential", 1, 1, 4),
    ("mixtral", "torch_dist", "local", "grouped", 1, 1, 1),
    ("moe_every_2nd_shared", "torch", "local", "sequential", 2, 1, 2),
    ("moe_every_2nd_shared", "torch_dist", "te", "grouped", 1, 1, 1),
    ("deepseek_v3", "torch_dist", "local", "grouped", 1, 1, 1),
    ("deepseek_v3", "torch_dist", "te", "grouped", 2, 1, 1),
    ("deepseek_v3_no_mtp", "torch", "local", "grouped", 2, 1, 1),
    ("deepseek_v3_no_mtp", "torch", "te", "sequential", 2, 2, 2),
]


@pytest.mark.parametrize("kind, fmt, spec, experts, tp, pp, ep", ROUND_TRIPS)
def test_round_trip_is_bit_identical(tmp_path, kind, fmt, spec, experts, tp, pp, ep):
    full = _save_ours(tmp_path / "ours", kind)
    convert_megatron.main(["--direction", "to-megatron", "--load", str(tmp_path / "ours"), "--save",
                           str(tmp_path / "mlm"), "--ckpt-format", fmt, "--layer-spec", spec, "--moe-experts", experts,
                           "--target-tensor-parallel-size", str(tp), "--target-pipeline-model-parallel-size", str(pp),
                           "--target-expert-model-parallel-size", str(ep)])
    it_dir = tmp_path / "mlm" / "iter_0000007"
    if fmt == "torch":
        suffix = lambda t, p, e: f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") + (f"_{e:03d}" if ep > 1 else "")  # noqa: E731
        assert sorted(os.listdir(it_dir)) == sorted(suffix(t, p, e) for t in range(tp) for p in range(pp)
                                                    for e in range(ep))
        saved = mf.read_megatron_file(str(it_dir / suffix(0, 0, 0) / mf.FILE))
        assert saved["checkpoint_version"] == 3.0 and saved["iteration"] == 7
        assert (saved["args"].tensor_model_parallel_size, saved["args"].pipeline_model_parallel_size) == (tp, pp)
    else:
        assert (it_dir / "metadata.json").is_file() and (it_dir / "common.pt").is_file()
        # Megatron-core keeps each ShardedObject as torch.save of the list of its objects: None for our linears
        extra = read_full_tensors(str(tmp_path / "mlm"), ["output_layer._extra_state/shard_0_1"], 7)
        assert extra == {"output_layer._extra_state/shard_0_1": [None]}
    convert_megatron.main(["--direction", "from-megatron", "--load", str(tmp_path / "mlm"), "--save",
                           str(tmp_path / "back")])
    config, back = load_full_state(str(tmp_path / "back"))
    assert config.model.num_layers == 2 and config.parallel.tensor_model_parallel_size == tp
    assert config.model.multi_latent_attention == MODELS[kind].multi_latent_attention
    assert sorted(back) == sorted(full)
    for name in full:
        assert torch.equal(back[name], full[name]), name


def test_args_are_read_without_pickle(tmp_path):
    """``args`` loads as a Namespace through the weights-only reader; any other global is one line, not run."""
    good = tmp_path / "good.pt"
    torch.save({"args": argparse.Namespace(num_layers=2)}, good)
    assert mf.read_megatron_file(str(good))["args"].num_layers == 2

    class Hostile:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    bad = tmp_path / "bad.pt"
    torch.save({"args": Hostile()}, bad, pickle_module=pickle)
    with pytest.raises(Exception, match="is refused: its pickle holds a reference to"):
        mf.read_megatron_file(str(bad))
    assert not (tmp_path / "pwned").exists()


def test_from_megatron_refuses_a_directory_of_something_else(tmp_path, capsys):
    (tmp_path / "x" / "iter_0000001").mkdir(parents=True)
    (tmp_path / "x" / "latest_checkpointed_iteration.txt").write_text("1")
    with pytest.raises(SystemExit):
        convert_megatron.main(["--direction", "from-megatron", "--load", str(tmp_path / "x"), "--save",
                               str(tmp_path / "y")])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a Megatron-LM checkpoint" in err[0]


@pytest.mark.parametrize("change, message", [
    ({"virtual_pipeline_model_parallel_size": 2}, "was saved with virtual pipeline stages"),
    ({"moe_router_load_balancing_type": "global_aux_loss"}, "--moe-router-load-balancing-type"),
])
def test_from_megatron_refuses_what_it_cannot_hold_in_one_line(tmp_path, capsys, change, message):
    _save_ours(tmp_path / "ours", "mixtral")
    convert_megatron.main(["--direction", "to-megatron", "--load", str(tmp_path / "ours"), "--save",
                           str(tmp_path / "mlm"), "--ckpt-format", "torch"])
    path = tmp_path / "mlm" / "iter_0000007" / "mp_rank_00" / mf.FILE
    saved = mf.read_megatron_file(str(path))
    vars(saved["args"]).update(change)
    torch.save(saved, path)
    capsys.readouterr()
    with pytest.raises(SystemExit):
        convert_megatron.main(["--direction", "from-megatron", "--load", str(tmp_path / "mlm"), "--save",
                               str(tmp_path / "back")])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "back").exists()
