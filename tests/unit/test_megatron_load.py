"""Megatron-LM checkpoints read directly (megatron_like/training/megatron_load.py) and the run state carried to and
from Megatron-LM's naming (tools/convert_megatron.py): optimizer moments and masters under Megatron-core's
``optimizer.state.<kind>.<model key>`` (its ``fully_sharded_model_space`` distributed-optimizer layout, read from
megatron-core 0.16.1's ``optimizer/distrib_optimizer.py`` ``sharded_param_state_fs_model_space``), the lr schedule
in samples (``opt_param_scheduler``), the step count in the param groups, the consumed samples in ``args``. The
resumed runs through the command line are in tests/e2e/test_cli_megatron_load.py."""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch

from megatron_like.config import Config
from megatron_like.model.state import load_full_state
from megatron_like.training import megatron_format as mf
from megatron_like.training.checkpoint_integrity import read_dcp_metadata
from megatron_like.training.checkpoint_validation import read_checkpoint_file
from megatron_like.training.checkpointing import CheckpointError
from megatron_like.training.dist_checkpointing import read_full_tensors, save_full_state
from megatron_like.training.megatron_load import check_megatron_checkpoint, megatron_kind, open_megatron
from tests.unit.test_megatron_names import EXPECTED, MODELS, _save_ours, full_state_of

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import convert_megatron  # noqa: E402

SCHEDULE = {"num_steps": 7, "max_lr": 1e-3, "min_lr": 1e-5, "warmup_iters": 2, "decay_iters": 20,
            "decay_style": "cosine"}


def _save_ours_with_optimizer(root, kind: str, masters: bool = False, rng: dict | None = None
                              ) -> dict[str, torch.Tensor]:
    """Our torch_dist checkpoint of a tiny ``kind`` model at iteration 7 with random AdamW moments (and fp32
    masters, as a bf16 run's), an lr schedule, a step count and consumed samples; returns its global state
    (``model.*``, ``optimizer.*``)."""
    config = Config()
    config.model = MODELS[kind]
    config.data.mock_data = True
    config.training.global_batch_size = 4
    config.validate()
    generator = torch.Generator().manual_seed(3)
    state = {"model." + k: v for k, v in full_state_of(kind).items()}
    for name, tensor in list(state.items()):
        for moment in ("exp_avg", "exp_avg_sq") + (("master",) if masters else ()):
            state[f"optimizer.{moment}.{name[len('model.'):]}"] = torch.randn(tensor.shape, generator=generator)
    save_full_state(str(root), 7, config, {**state, **(rng or {})}, extra={
        "consumed_samples": 28, "scheduler": SCHEDULE, "optimizer": {"step": 7.0, "loss_scaler": None}})
    return state


def _to_megatron(tmp_path, *flags: str) -> None:
    convert_megatron.main(["--direction", "to-megatron", "--load", str(tmp_path / "ours"), "--save",
                           str(tmp_path / "mlm"), *flags])


def test_optimizer_keys_scheduler_and_step_in_megatron_naming(tmp_path):
    ours = _save_ours_with_optimizer(tmp_path / "ours", "gpt2")
    _to_megatron(tmp_path)
    it_dir = str(tmp_path / "mlm" / "iter_0000007")
    model_keys, optimizer_keys = mf.model_and_optimizer_keys(it_dir)
    expected = EXPECTED[("gpt2", "local")]
    assert sorted(model_keys) == sorted(expected)
    # fp32_param: Megatron-core's distributed optimizer keeps fp32 masters also for an fp32 model (its params here)
    assert sorted(optimizer_keys) == sorted(f"optimizer.state.{kind}.{key}" for key in expected
                                            for kind in ("exp_avg", "exp_avg_sq", "fp32_param"))
    tensors = read_full_tensors(str(tmp_path / "mlm"), optimizer_keys, 7)
    for key, tensor in tensors.items():
        assert tuple(tensor.shape) == expected[key.split(".", 3)[3]], key
    fc1 = "decoder.layers.mlp.linear_fc1.weight"  # stacked [L, 4h, h]: layer 1's moment is ours of layers.1
    assert torch.equal(tensors[f"optimizer.state.exp_avg.{fc1}"][1], ours["optimizer.exp_avg.layers.1.mlp.fc1.weight"])
    common = mf.read_megatron_file(os.path.join(it_dir, "common.pt"))
    assert common["args"].consumed_train_samples == 28 and common["args"].global_batch_size == 4
    assert common["opt_param_scheduler"] == {  # Megatron-LM counts samples: iterations x global batch 4
        "max_lr": 1e-3, "min_lr": 1e-5, "lr_warmup_steps": 8, "num_steps": 28, "lr_decay_style": "cosine",
        "lr_decay_steps": 80, "start_wd": 0.01, "end_wd": 0.01, "wd_incr_style": "constant", "wd_incr_steps": 40}
    assert common["optimizer"]["param_state_sharding_type"] == "fully_sharded_model_space"
    assert [g["step"] for g in common["optimizer"]["optimizer"]["param_groups"]] == [7.0, 7.0]


LEGACY_LAYOUT = ["--ckpt-format", "torch", "--target-tensor-parallel-size", "2",
                 "--target-pipeline-model-parallel-size", "2"]


@pytest.mark.parametrize("kind, spec, flags, masters", [
    ("llama", "te", [], False), ("mixtral", "local", [], False),
    # legacy files: each rank's optimizer entry, tied embedding's last-stage copy, experts' own optimizer at ep 2
    ("gpt2", "local", LEGACY_LAYOUT, False), ("mixtral", "local", LEGACY_LAYOUT + ["--moe-experts", "sequential",
                                                                                 "--target-expert-model-parallel-size",
                                                                                 "2"], True)])
def test_optimizer_state_round_trip_is_bit_identical(tmp_path, kind, spec, flags, masters):
    """Moments go through the same fused layouts as the weights (SwiGLU gate/up, experts transposed, stacking)."""
    ours = _save_ours_with_optimizer(tmp_path / "ours", kind, masters)
    _to_megatron(tmp_path, "--layer-spec", spec, *flags)
    convert_megatron.main(["--direction", "from-megatron", "--load", str(tmp_path / "mlm"), "--save",
                           str(tmp_path / "back")])
    back_dir = str(tmp_path / "back" / "iter_0000007")
    keys = sorted(read_dcp_metadata(back_dir).state_dict_metadata)
    # torch_dist keeps fp32 masters for an fp32 model too (its params); the legacy FP32Optimizer keeps none
    fp32_params = {"optimizer.master." + k[len("model."):] for k in ours if k.startswith("model.") and not flags}
    assert keys == sorted(set(ours) | fp32_params)
    back = read_full_tensors(str(tmp_path / "back"), keys, 7)
    for key, tensor in ours.items():
        assert torch.equal(back[key], tensor), key
    common = read_checkpoint_file(os.path.join(back_dir, "common.pt"))
    assert common["scheduler"] == SCHEDULE and common["consumed_samples"] == 28
    assert common["optimizer"]["step"] == 7.0


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_load_full_state_reads_megatron_checkpoints(tmp_path, fmt):
    """Generation, evaluation, the server and the HF exporter read a Megatron-LM directory as ours."""
    full = _save_ours(tmp_path / "ours", "llama")
    _to_megatron(tmp_path, "--ckpt-format", fmt, "--target-tensor-parallel-size", "2")
    assert megatron_kind(str(tmp_path / "mlm" / "iter_0000007")) == fmt
    assert megatron_kind(str(tmp_path / "ours" / "iter_0000007")) is None
    config, back = load_full_state(str(tmp_path / "mlm"))
    assert config.model.swiglu and config.model.num_layers == 2 and sorted(back) == sorted(full)
    for name in full:
        assert torch.equal(back[name], full[name]), name


def _run_config(**model_changes) -> Config:
    config = Config()
    config.model = dataclasses.replace(MODELS["gpt2"], **model_changes)
    return config


# megatron-core 0.16.1's GPTModel (local spec, CPU) named_parameters of the gpt2 model, as seen from it: the order of
# the legacy files' model entries and of the non-distributed optimizer's parameters
GPT2_PARAMETERS = ["embedding.word_embeddings.weight", "embedding.position_embeddings.weight"] + [
    f"decoder.layers.{i}.{rest}" for i in range(2) for rest in (
        "input_layernorm.weight", "input_layernorm.bias", "self_attention.linear_proj.weight",
        "self_attention.linear_proj.bias", "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
        "pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias", "mlp.linear_fc1.weight", "mlp.linear_fc1.bias",
        "mlp.linear_fc2.weight", "mlp.linear_fc2.bias")] + ["decoder.final_layernorm.weight",
                                                            "decoder.final_layernorm.bias"]


def test_legacy_optimizer_entry_in_megatron_lms_order(tmp_path):
    """What Megatron-LM's default (non-distributed) optimizer saves in a legacy file, seen from megatron-core 0.16.1
    on CPU: torch AdamW's state dict, parameters numbered through the groups (decayed, then biases and 1-D), each
    group in the model's parameter order, a ``step`` per parameter; tp rank 1 holds its slices."""
    from megatron_like.training.megatron_legacy_optim import parameter_names

    ours = _save_ours_with_optimizer(tmp_path / "ours", "gpt2")
    _to_megatron(tmp_path, "--ckpt-format", "torch", "--target-tensor-parallel-size", "2")
    saved = mf.read_megatron_file(str(tmp_path / "mlm" / "iter_0000007" / "mp_rank_01" / mf.FILE))
    assert parameter_names(saved["model"]) == GPT2_PARAMETERS
    entry = saved["optimizer"]
    assert [(g["wd_mult"], g["params"]) for g in entry["param_groups"]] == [(1.0, list(range(10))),
                                                                         (0.0, list(range(10, 28)))]
    decayed = [n for n in GPT2_PARAMETERS if n.endswith("weight") and "norm" not in n]
    fc1 = entry["state"][decayed.index("decoder.layers.1.mlp.linear_fc1.weight")]
    assert float(fc1["step"]) == 7.0
    assert torch.equal(fc1["exp_avg"], ours["optimizer.exp_avg.layers.1.mlp.fc1.weight"].chunk(2)[1])
    bias = entry["state"][10 + [n for n in GPT2_PARAMETERS if n not in decayed].index(
        "decoder.layers.0.self_attention.linear_proj.bias")]
    assert torch.equal(bias["exp_avg_sq"], ours["optimizer.exp_avg_sq.layers.0.attention.proj.bias"])


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_rng_states_travel_as_megatron_lms_rng_state(tmp_path, fmt):
    """Our generators (data-parallel rank 0's) become Megatron-LM's ``rng_state`` (training/checkpointing.py
    ``get_rng_state``: python's and numpy's states as they return them, torch's, the tracker's) and come back equal."""
    import random

    import numpy as np

    from megatron_like.tensor_parallel import seed_everything
    from megatron_like.training.checkpointing import rng_state
    from megatron_like.training.megatron_load import read_megatron_rng

    seed_everything(77, tp_rank=0, pp_rank=0)
    random.random(), np.random.rand(3), torch.rand(5)  # noqa: B018 - generators away from their seeded start
    generators = rng_state()
    _save_ours_with_optimizer(tmp_path / "ours", "gpt2", rng={"rng.tp0.pp0.dp0": generators})
    _to_megatron(tmp_path, "--ckpt-format", fmt)
    it_dir = str(tmp_path / "mlm" / "iter_0000007")
    if fmt == "torch":
        entry = mf.read_megatron_file(os.path.join(it_dir, "mp_rank_00", mf.FILE))["rng_state"]
        assert len(entry) == 1 and sorted(entry[0]) == ["np_rng_state", "random_rng_state", "rng_tracker_states",
                                                        "torch_rng_state"]
        version, python_keys, _ = entry[0]["random_rng_state"]  # random.getstate()'s (3, keys and position, gauss)
        assert version == 3 and list(python_keys) == generators["python"]
        assert entry[0]["np_rng_state"][0] == "MT19937" and entry[0]["np_rng_state"][1].dtype == np.uint32
    back = read_megatron_rng(open_megatron(it_dir, fmt), 0, 0)
    assert back["python"] == generators["python"] and back["numpy_pos"] == generators["numpy_pos"]
    assert torch.equal(back["numpy_keys"], generators["numpy_keys"]) and torch.equal(back["torch"], generators["torch"])
    assert back["tracker"].keys() == generators["tracker"].keys() == {"model-parallel-rng"}
    assert torch.equal(back["tracker"]["model-parallel-rng"], generators["tracker"]["model-parallel-rng"])


def test_refusals_are_one_line(tmp_path):
    _save_ours_with_optimizer(tmp_path / "ours", "gpt2")
    _to_megatron(tmp_path, "--ckpt-format", "torch")
    legacy = open_megatron(str(tmp_path / "mlm" / "iter_0000007"), "torch")
    (tmp_path / "mlm" / "iter_0000007" / "mp_rank_00" / "distrib_optim.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="distributed optimizer's legacy distrib_optim.pt .* --no-load-optim"):
        check_megatron_checkpoint(legacy, _run_config())
    with pytest.raises(CheckpointError, match="has --num-layers 2 but this run has 3; pass the checkpoint's value"):
        check_megatron_checkpoint(legacy, _run_config(num_layers=3))
    legacy.common["opt_param_scheduler"] = {"lr_decay_style": "WSD"}
    with pytest.raises(CheckpointError, match="--lr-decay-style WSD, not implemented here"):
        check_megatron_checkpoint(legacy, _run_config())


def test_dp_reshardable_optimizer_is_refused_in_one_line(tmp_path):
    """Megatron-LM's default distributed-optimizer layout holds flat buckets of one dp layout: refused, named."""
    from megatron_like.training.dist_checkpointing import write_global_state

    write_global_state(str(tmp_path), {"optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_0.param": torch.ones(4),
                                       "embedding.word_embeddings.weight": torch.ones(2, 2)})
    with pytest.raises(CheckpointError, match="dp_reshardable .* --no-load-optim, or .* "
                                              "--dist-ckpt-optim-fully-reshardable"):
        mf.model_and_optimizer_keys(str(tmp_path))


def test_an_index_with_megatron_cores_save_plans_is_read(tmp_path):
    """Megatron-core's save adds every rank's save plan to the DCP index (``all_local_plans``, seen in a file its
    ``dist_checkpointing.save`` wrote: tests/megatron_core): its records are read, nothing else is allowed."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    from megatron_like.training.dist_checkpointing import write_global_state

    weight = torch.arange(6.0).reshape(2, 3)
    it_dir = tmp_path / "iter_0000001"
    write_global_state(str(it_dir), {"output_layer.weight": weight})
    index_path = it_dir / ".metadata"
    index = torch.serialization.pickle.loads(index_path.read_bytes())  # our own file, written just above
    item = WriteItem(index=MetadataIndex("output_layer.weight", torch.Size([0, 0])), type=WriteItemType.SHARD,
                     tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size([0, 0]), weight.shape),
                                                 properties=TensorProperties.create_from_tensor(weight),
                                                 size=weight.shape))
    index.all_local_plans = [SavePlan(items=[item], planner_data={})]
    index_path.write_bytes(torch.serialization.pickle.dumps(index))
    assert torch.equal(mf.load_torch_dist(str(it_dir), ["output_layer.weight"])["output_layer.weight"], weight)
