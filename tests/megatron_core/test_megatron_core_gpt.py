"""Megatron-core's own GPTModel (megatron-core 0.16.1, local layer spec, CPU, one gloo process) against ours,
through tools/convert_megatron.py: our checkpoint exported to Megatron-core's torch_dist loads with its
``dist_checkpointing.load`` (strict about keys and shapes) into its GPTModel and gives our logits; its module
state dict (the legacy files' names) maps back to exactly our keys; and a checkpoint its own
``dist_checkpointing.save`` wrote (its writer's buckets written in process) gives its logits through our readers.
Skipped where megatron-core is not importable (conftest.py)."""

from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch
import torch.nn.functional as F

from megatron_like.inference import load_inference_model
from megatron_like.model import megatron_names as names
from megatron_like.model.state import load_full_state
from megatron_like.parallel_state import ParallelState
from tests.distributed.harness import free_port
from tests.unit.test_megatron_names import MODELS, _save_ours

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import convert_megatron  # noqa: E402

IDS = torch.randint(0, 60, (2, 16), generator=torch.Generator().manual_seed(5))
POSITIONS = torch.arange(IDS.shape[1]).expand_as(IDS)
CAUSAL = torch.ones(IDS.shape[1], IDS.shape[1], dtype=torch.bool).triu(1)[None, None]
"""Megatron-core's mask (True: not attended), given since its default causal mask is made on the CUDA device."""


@pytest.fixture(scope="module")
def megatron_core():
    """Megatron-core's model-parallel state on one gloo process (torch.distributed started here), with its few
    CUDA-only spots pointed at the CPU: scratch buffers and RoPE frequencies go to ``torch.cuda.current_device()``,
    and attention forks the CUDA generators' tracker around its dropout (off here: 0.0)."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    saved = torch.cuda.current_device, tensor_parallel.get_cuda_rng_tracker().fork
    torch.cuda.current_device = lambda: torch.device("cpu")
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    torch.cuda.current_device, tensor_parallel.get_cuda_rng_tracker().fork = saved


def build_megatron_gpt(kind: str):
    """Megatron-core's GPTModel with our tiny model's architecture (local spec, no fusions, fp32 on CPU)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    m = MODELS[kind]
    llama = m.swiglu
    config = TransformerConfig(
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
        num_query_groups=m.query_groups, ffn_hidden_size=m.ffn_size, layernorm_epsilon=m.norm_epsilon,
        normalization=m.normalization, gated_linear_unit=llama, activation_func=F.silu if llama else
        (lambda x: F.gelu(x, approximate="tanh")), add_bias_linear=m.linear_bias, hidden_dropout=0.0,
        attention_dropout=0.0, use_cpu_initialization=True, bias_activation_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        bias_dropout_fusion=False)
    model = GPTModel(config, get_gpt_layer_local_spec(normalization=m.normalization), vocab_size=64,
                     max_sequence_length=m.max_positions, position_embedding_type=m.position_embedding_type,
                     share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights)
    return model.eval()


def megatron_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS, POSITIONS, attention_mask=CAUSAL)[..., :60]


def our_logits(root: str) -> torch.Tensor:
    loaded = load_inference_model(root, ParallelState.single_process(torch.device("cpu")))
    with torch.no_grad():
        return loaded.model[0](IDS, POSITIONS)[..., :60]


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_megatron_core_reads_our_export_and_we_read_its_save(tmp_path, megatron_core, kind):
    from megatron.core import dist_checkpointing

    _save_ours(tmp_path / "ours", kind)
    convert_megatron.main(["--direction", "to-megatron", "--load", str(tmp_path / "ours"), "--save",
                           str(tmp_path / "mlm")])
    model = build_megatron_gpt(kind)
    loaded = dist_checkpointing.load(model.sharded_state_dict(), str(tmp_path / "mlm" / "iter_0000007"))
    model.load_state_dict(loaded, strict=False)
    ours = our_logits(str(tmp_path / "ours"))
    # fp32 rounding: 1e-5 with our pure-PyTorch fallbacks, up to 8e-5 on these logits with the compiled kernels
    # (another summation order); a wrong layout (gate/up order, a norm left out) differs by O(1)
    torch.testing.assert_close(megatron_logits(model), ours, rtol=2e-4, atol=2e-4)

    # Megatron-core's own weights (its module state dict) back through our reader of its names: our logits
    mstate = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    back = names.from_megatron_layers(mstate, MODELS[kind])
    full = load_full_state(str(tmp_path / "ours"))[1]
    assert sorted(back) == sorted(full)
    for name in full:
        assert torch.equal(back[name], full[name]), name


@contextlib.contextmanager
def writes_in_process():
    """Megatron-core's torch_dist writer without its processes: its results queue (a ``multiprocessing`` Manager,
    a forked server) and its forked writer per bucket hang in this CPU set-up, so each bucket is written here, in
    turn, by its own ``write_preloaded_data`` (the bytes and the index are its writer's); its staging waits for the
    CUDA device after copying to the host (nothing to wait for on the CPU), and its memory log needs psutil."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    def in_turn(transform_list, use_msc, rank, write_buckets, global_results_queue):
        results, counts, written = queue.Queue(), queue.Queue(), {}
        for index, bucket in enumerate(write_buckets):
            counts.put(index)
            fa.FileSystemWriterAsync.write_preloaded_data(transform_list, index, bucket, results, counts, True)
            index, result = results.get()
            if isinstance(result, Exception):
                global_results_queue.put(result)
                return
            written[index] = result
        global_results_queue.put(written)

    saved = (fa._get_write_results_queue, fa.FileSystemWriterAsync.write_preloaded_data_multiproc,
             torch.cuda.synchronize, fa._process_memory)
    fa._get_write_results_queue, fa._process_memory = queue.Queue, lambda: 0
    fa.FileSystemWriterAsync.write_preloaded_data_multiproc = staticmethod(in_turn)
    torch.cuda.synchronize = lambda *args: None
    try:
        yield
    finally:
        fa._get_write_results_queue, torch.cuda.synchronize, fa._process_memory = saved[0], saved[2], saved[3]
        fa.FileSystemWriterAsync.write_preloaded_data_multiproc = staticmethod(saved[1])


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_we_load_a_checkpoint_megatron_core_saved(tmp_path, megatron_core, kind):
    """Megatron-core's ``dist_checkpointing.save`` of its GPTModel (its keys, stacking, fused layouts, metadata.json,
    common.pt; ``args`` from our writer, as Megatron-LM's trainer adds its own) read by ``--load``'s reader and by
    generation: our model gives its logits."""
    from megatron.core import dist_checkpointing

    from megatron_like.training import megatron_format as mf
    from megatron_like.training.checkpointing import write_tracker

    _save_ours(tmp_path / "ours", kind)  # only to give Megatron-core's model our weights and args their values
    convert_megatron.main(["--direction", "to-megatron", "--load", str(tmp_path / "ours"), "--save",
                           str(tmp_path / "export")])
    model = build_megatron_gpt(kind)
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(),
                                                  str(tmp_path / "export" / "iter_0000007")), strict=False)
    args = mf.read_megatron_file(str(tmp_path / "export" / "iter_0000007" / "common.pt"))["args"]
    it_dir = tmp_path / "mlm" / "iter_0000005"
    it_dir.mkdir(parents=True)
    with writes_in_process():
        dist_checkpointing.save({"model": model.sharded_state_dict(), "args": args, "iteration": 5,
                                 "checkpoint_version": 3.0}, str(it_dir))
    write_tracker(str(tmp_path / "mlm"), 5)
    config, full = load_full_state(str(tmp_path / "mlm"))
    ours = load_full_state(str(tmp_path / "ours"))[1]
    assert config.model.num_layers == 2 and sorted(full) == sorted(ours)
    for name in ours:
        assert torch.equal(full[name], ours[name]), name
    torch.testing.assert_close(our_logits(str(tmp_path / "mlm")), megatron_logits(model), rtol=2e-4, atol=2e-4)


def megatron_core_optimizer(model):
    """Megatron-core's own optimizer of ``model`` as Megatron-LM builds it by default (non-distributed, AdamW; fp32
    params: its FP32Optimizer), its few CUDA-only tensors (a loss-scale constant) made on the CPU."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    tensor = torch.tensor

    def on_cpu(*args, **kwargs):
        return tensor(*args, **{**kwargs, "device": "cpu"} if kwargs.get("device") == "cuda" else kwargs)

    torch.tensor = on_cpu
    try:
        return get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.01,
                                                      use_distributed_optimizer=False), [ddp])
    finally:
        torch.tensor = tensor


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_megatron_core_optimizer_and_ours_read_each_others_legacy_optimizer_entry(tmp_path, megatron_core, kind):
    """Our legacy file's ``optimizer`` entry loads into Megatron-core's own optimizer (``load_state_dict``): each of
    its parameters gets our moments and step; and its ``state_dict()`` after a step of its own reads back here
    (``read_optimizer_entry``) as its per-parameter state."""
    from megatron_like.training import megatron_format as mf
    from megatron_like.training.megatron_legacy_optim import read_optimizer_entry
    from tests.unit.test_megatron_load import _save_ours_with_optimizer

    ours = _save_ours_with_optimizer(tmp_path / "ours", kind)
    convert_megatron.main(["--direction", "to-megatron", "--load", str(tmp_path / "ours"), "--save",
                           str(tmp_path / "mlm"), "--ckpt-format", "torch"])
    saved = mf.read_megatron_file(str(tmp_path / "mlm" / "iter_0000007" / "mp_rank_00" / mf.FILE))
    model = build_megatron_gpt(kind)
    model.load_state_dict(saved["model"], strict=False)
    optimizer = megatron_core_optimizer(model)
    optimizer.load_state_dict(saved["optimizer"])
    adamw = optimizer.chained_optimizers[0].optimizer
    params = dict(model.named_parameters())
    theirs = {name: adamw.state[param]["exp_avg"] for name, param in params.items()}
    expected = names.to_megatron_layers({k[len("optimizer.exp_avg."):]: v for k, v in ours.items()
                                         if k.startswith("optimizer.exp_avg.")}, MODELS[kind], sharded=False)
    assert sorted(theirs) == sorted(expected)
    for name, moment in theirs.items():
        assert torch.equal(moment, expected[name]), name
    assert {float(adamw.state[p]["step"]) for p in params.values()} == {7.0}

    for param in params.values():
        param.grad = torch.randn_like(param)
    adamw.step()
    moments, step = read_optimizer_entry(saved["model"], optimizer.state_dict(), "its state_dict")
    assert step == 8.0 and sorted(moments) == ["exp_avg", "exp_avg_sq"]
    for name, param in params.items():
        assert torch.equal(moments["exp_avg_sq"][name], adamw.state[param]["exp_avg_sq"]), name


@contextlib.contextmanager
def mla_without_transformer_engine():
    """Megatron-core's MLA layer built without Transformer Engine, for its names only: its TE classes (compared with
    ``isinstance``) become empty stand-ins, and the local attention core ignores the MLA head sizes it does not
    take (it has no parameters; nothing here runs it)."""
    import megatron.core.transformer.multi_latent_attention as mla
    from megatron.core.transformer import dot_product_attention as dpa

    saved = dict(vars(mla)), dpa.DotProductAttention.__init__
    for name in ("TELinear", "TEColumnParallelLinear", "TELayerNormColumnParallelLinear"):
        if not isinstance(getattr(mla, name, None), type):
            setattr(mla, name, type(name, (), {}))

    def without_head_sizes(self, *args, k_channels=None, v_channels=None, **kwargs):
        saved[1](self, *args, **kwargs)

    dpa.DotProductAttention.__init__ = without_head_sizes
    try:
        yield
    finally:
        vars(mla).update(saved[0])
        dpa.DotProductAttention.__init__ = saved[1]


def test_megatron_cores_deepseek_v3_keys_are_the_ones_written_down(megatron_core):
    """Megatron-core's own GPTModel of the DeepSeek-V3-shaped model (MLA, local spec; MoE on layer 1 with a shared
    expert, sigmoid routing with the expert bias; one MTP depth): its ``sharded_state_dict`` keys and global shapes
    are tests/unit/test_megatron_names.py's list, our export holds its ``_extra_state`` objects, and its parameters
    come in the order our legacy files use."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from megatron_like.training.megatron_format import extra_state_keys, module_order
    from tests.unit.test_megatron_names import EXPECTED

    m = MODELS["deepseek_v3"]
    config = MLATransformerConfig(
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
        ffn_hidden_size=m.ffn_size, normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, use_cpu_initialization=True, q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
        qk_head_dim=m.qk_head_dim, qk_pos_emb_head_dim=m.qk_pos_emb_head_dim, v_head_dim=m.v_head_dim,
        qk_layernorm=True, rope_type="rope", num_moe_experts=m.num_experts, moe_router_topk=m.moe_router_topk,
        moe_ffn_hidden_size=m.moe_ffn_size, moe_layer_freq=[0, 1], moe_shared_expert_intermediate_size=8,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, mtp_num_layers=1)
    with mla_without_transformer_engine():
        block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
        mtp = get_gpt_mtp_block_spec(config, block.layer_specs[-1], use_transformer_engine=False)
        model = GPTModel(config, block, vocab_size=64, max_sequence_length=m.max_positions,
                         position_embedding_type="rope", share_embeddings_and_output_weights=False,
                         mtp_block_spec=mtp)
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    keys, objects = {}, set()
    for value in model.sharded_state_dict().values():  # SwiGLU fc1s are factories: the tensors they build
        built = nested_values(value.build()) if isinstance(value, ShardedTensorFactory) else [value]
        keys.update({t.key: tuple(t.global_shape) for t in built if isinstance(t, ShardedTensor)})
        objects.update(t.unique_key for t in built if isinstance(t, ShardedObject))
    assert keys == EXPECTED["deepseek_v3", "local"]
    # its _extra_state objects are in our export, but for its SequentialMLP's per-expert linears (built here without
    # the grouped_gemm package; our args declare --moe-grouped-gemm, whose GroupedMLP holds none)
    sequential = {k for k in objects if ".mlp.experts.experts.linear_fc" in k}
    assert sequential and objects - sequential <= set(extra_state_keys(m, "local"))
    decoder = [n for n, _ in model.named_parameters() if not n.startswith("mtp.")]
    assert decoder == sorted(decoder, key=module_order)
