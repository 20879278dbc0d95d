"""``--ckpt-format torch_dist`` loads at another layout and training continues as if never interrupted.

One group of 4 processes, both directions between
  A = tp2 x pp2 with 2 virtual stages per rank, ZeRO-1 over dp 1, and
  B = tp1 x pp2 x dp2, ZeRO-3 with the optimizer offloaded to the CPU:
a straight run of 4 iterations at the saving layout also saves at iteration 2; a second run at the other
layout loads that checkpoint (weights, fp32 masters, Adam moments and step, lr schedule, data position)
and trains iterations 3-4. Its losses, grad norms and final weights must equal the straight run's within
float32 tolerance (the two layouts compute the same model, see test_zero.py and test_pipeline_parallel.py). The
model has Qwen3's QK-norm (here LayerNorm's, weight and bias) and heads wider than hidden / heads.

--async-save (bf16, ZeRO-2 over dp 2): the checkpoint staged and written in the background while the next
iteration runs equals a synchronous save of the same iteration bitwise, holds the state of the
iteration it was taken at and resumes bitwise (dropout on, fp32 masters included); the run ends only
once its last checkpoint is named by the tracker.

Mixture of experts (one more group of 4): a torch_dist checkpoint of ep2 x tp2 continues at ep4 with ZeRO-3 and
at ep1 x pp2 with ZeRO-2 like the straight run (losses, router losses, grad norms, weights), resumes bitwise at
its own layout, and holds every expert once at its global place; the torch format at ep2 (a directory per ep
rank) resumes bitwise and refuses another ep in one line. Expert tensor parallelism other than tp: that checkpoint
continues at tp2 + sp with etp 1 (ZeRO-1 over the expert-data-parallel group, saving again), and one saved at
tp2 + sp, etp 1, ep 2 continues at tp 1 with etp 2 (ZeRO-2), each like its straight run; both hold their run's
weights at the global places the inference tools read; the torch format refuses etp other than tp in one line.

DeepSeek routing (a group of 2, ep 2): the expert bias, a buffer moved after every step, resumes bitwise in
both formats (losses, router losses, biases at every iteration, weights).
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

from megatron_like import collectives as comm
from megatron_like.training.checkpointing import write_tracker
from tests.distributed.gpt_runs import assert_same_training, merge_ranks, train_gpt
from tests.distributed.harness import run_distributed

A = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--zero-stage", "1",
     "--num-layers-per-virtual-pipeline-stage", "1"]
B = ["--pipeline-model-parallel-size", "2", "--zero-stage", "3", "--optimizer-cpu-offload"]
FLAGS = ["--ckpt-format", "torch_dist", "--train-iters", "4", "--lr-warmup-iters", "1",
         "--lr-decay-style", "cosine"]
QK_NORM = ["--qk-layernorm", "--kv-channels", "32"]
"""The layout test's model also has QK-norm (LayerNorm: weight and bias, replicated over tp) and 32-feature heads."""


def straight_then_other_layout(rank: int, world_size: int, root: str) -> dict:
    out = {}
    for name, saving, loading in (("A_to_B", A, B), ("B_to_A", B, A)):
        directory = os.path.join(root, name)
        straight = train_gpt(rank, world_size, FLAGS + QK_NORM + saving + ["--save", directory, "--save-interval",
                                                                             "2"])
        if rank == 0:  # the straight run also saved iteration 4: resume from 2
            write_tracker(directory, 2)
        comm.barrier()
        resumed = train_gpt(rank, world_size, FLAGS + QK_NORM + loading + ["--load", directory])
        out[name] = {"straight": straight, "resumed": resumed}
    return out


def test_torch_dist_checkpoint_continues_at_another_layout(tmp_path):
    results = run_distributed(straight_then_other_layout, 4, str(tmp_path))
    for name in ("A_to_B", "B_to_A"):
        straight = merge_ranks([r[name]["straight"] for r in results])
        resumed = merge_ranks([r[name]["resumed"] for r in results])
        assert len(straight["losses"]) == 4 and len(resumed["losses"]) == 2, name
        straight["losses"], straight["grad_norms"] = straight["losses"][2:], straight["grad_norms"][2:]
        assert_same_training(straight, resumed)


def async_save_then_resume(rank: int, world_size: int, root: str) -> dict:
    from megatron_like.optimizer.distributed_optimizer import DistributedOptimizer
    from megatron_like.training import dist_checkpointing
    from megatron_like.training.checkpointing import latest_iteration
    from tests.distributed.test_checkpoint_resume import RESUME_FLAGS

    # The background thread of a save copies the state only once the training thread waits for the copy or
    # has run the next optimizer step (or ends), and writes only after that step: what it writes must be the
    # state of the save's iteration, copied before the step changed it. Gates per thread: no timing involved.
    gates: dict[tuple[threading.Thread, str], threading.Event] = {}

    def gate(thread: threading.Thread | None, kind: str) -> threading.Event:
        return gates.setdefault((thread, kind), threading.Event())

    def release(*kinds: str) -> None:  # the gates of the running save's thread
        for kind in kinds:
            gate(dist_checkpointing._AsyncWrite.thread, kind).set()

    step, wait_staging, wait_save = (DistributedOptimizer.step, dist_checkpointing.wait_for_async_staging,
                                     dist_checkpointing.wait_for_async_save)

    def step_then_release(self: DistributedOptimizer, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - step's own
        result = step(self, *args, **kwargs)
        release("copy", "write")  # a copy nothing waited for now sees the step's changes
        return result

    def release_then_wait_staging() -> None:
        release("copy")
        wait_staging()

    def release_then_wait_save(*args) -> None:  # noqa: ANN002 - wait_for_async_save's own arguments
        release("copy", "write")
        wait_save(*args)

    DistributedOptimizer.step = step_then_release
    dist_checkpointing.wait_for_async_staging = release_then_wait_staging
    dist_checkpointing.wait_for_async_save = release_then_wait_save
    dist_checkpointing.before_async_staging = lambda: gate(threading.current_thread(), "copy").wait()
    dist_checkpointing.before_async_write = lambda: gate(threading.current_thread(), "write").wait()
    # bf16: the separate fp32 masters are saved and loaded too.
    flags = RESUME_FLAGS + ["--zero-stage", "2", "--bf16", "--ckpt-format", "torch_dist", "--train-iters", "4",
                            "--save-interval", "2"]
    train_gpt(rank, world_size, flags + ["--save", os.path.join(root, "sync")])
    straight = train_gpt(rank, world_size, flags + ["--async-save", "--save", os.path.join(root, "async")])
    finished_at = latest_iteration(os.path.join(root, "async"))  # the end of training waited for the last write
    comm.barrier()
    if rank == 0:
        write_tracker(os.path.join(root, "async"), 2)
    comm.barrier()
    resumed = train_gpt(rank, world_size, flags + ["--async-save", "--load", os.path.join(root, "async")])
    return {"straight": straight["losses"], "resumed": resumed["losses"], "finished_at": finished_at}


def saved_state(root: str, iteration: int) -> dict:
    """Every tensor and plain value (RNG states) of a torch_dist checkpoint."""
    from torch.distributed.checkpoint import FileSystemReader

    from megatron_like.training.dist_checkpointing import read_full_tensors

    keys = list(FileSystemReader(os.path.join(root, f"iter_{iteration:07d}")).read_metadata().state_dict_metadata)
    return read_full_tensors(root, keys, iteration)


def test_async_save_writes_the_state_of_its_iteration_and_resumes_bitwise(tmp_path):
    """Staged during the next iteration, an async save equals a sync save of the same iteration bitwise
    (params, bf16 and fp32 masters, Adam moments, RNG states of both ranks)."""
    results = run_distributed(async_save_then_resume, 2, str(tmp_path))
    for iteration in (2, 4):
        sync, saved = saved_state(str(tmp_path / "sync"), iteration), saved_state(str(tmp_path / "async"), iteration)
        assert sorted(sync) == sorted(saved) and any(k.startswith("optimizer.master.") for k in sync)
        for key, value in sync.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, saved[key]), (iteration, key)
            else:
                assert_same_values(value, saved[key], (iteration, key))
    for r in results:
        assert r["finished_at"] == 4
        assert len(r["straight"]) == 4 and r["resumed"] == r["straight"][2:]


# ------------------------------------------------------------------ mixture of experts at ep > 1
# docs/moe.md: the tiny Mixtral-like model of test_moe_parallel.py (layers 0, 1, 3 MoE, 4 experts, shared expert).
MOE_FLAGS = ["--train-iters", "4", "--lr-warmup-iters", "1", "--lr-decay-style", "cosine", "--save-interval", "2"]
# Saved without ZeRO: expert-data-parallel rank 0 of each ep rank writes its experts (dp rank 0 holds only half).
MOE_SAVING = ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
              "--moe-token-dispatcher-type", "alltoall"]
MOE_LOADING = {  # expert weights and Adam state re-cut over 4, 2 and 1 expert-parallel ranks, tp 2 -> 1 (and pp 2)
    "ep4-zero3": ["--expert-model-parallel-size", "4", "--zero-stage", "3", "--moe-token-dispatcher-type", "alltoall"],
    "ep1-pp2-zero2": ["--pipeline-model-parallel-size", "2", "--zero-stage", "2"],
    # etp 1 inside tp 2 (the tp ranks become ep ranks), saved again from ZeRO-1 shards over expert-dp 2
    "etp1-tp2-sp-ep2-zero1": ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1",
                              "--tensor-model-parallel-size", "2", "--sequence-parallel", "--zero-stage", "1",
                              "--moe-token-dispatcher-type", "alltoall"],
}
# Saved at etp 1 inside tp 2 + sp without ZeRO (expert-dp rank 0 of each ep rank writes), loaded at etp 2 with tp 1:
# each expert now split over two data-parallel ranks.
ETP_SAVING = ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1",
              "--tensor-model-parallel-size", "2", "--sequence-parallel", "--moe-token-dispatcher-type", "alltoall"]
ETP_LOADING = ["--expert-tensor-parallel-size", "2", "--zero-stage", "2", "--moe-token-dispatcher-type", "allgather"]
# The torch format (a file per rank) at ep 2 inside dp 4 with ZeRO-3: two ranks hold each expert's shards.
MOE_TORCH_SAVING = ["--expert-model-parallel-size", "2", "--zero-stage", "3", "--moe-token-dispatcher-type", "alltoall"]


def moe_checkpoints(rank: int, world_size: int, root: str) -> dict:
    """One spawn for every MoE checkpoint check: torch_dist at another ep layout and at the same one, then
    the torch format at the same ep layout (bitwise) and at another (a one-line error)."""
    from megatron_like.training.checkpointing import CheckpointError
    from tests.distributed.test_moe_parallel import MOE

    out: dict = {}

    def train(name: str, flags: list[str], directory: str) -> None:
        out[name] = train_gpt(rank, world_size, MOE + MOE_FLAGS + flags)
        comm.barrier()
        if rank == 0 and os.path.exists(os.path.join(directory, "latest_checkpointed_iteration.txt")):
            write_tracker(directory, 2)  # the straight run also saved iteration 4: resume from 2
        comm.barrier()

    dist_dir, torch_dir, sharded_dir, etp_dir, etp_sharded_dir = (
        os.path.join(root, name) for name in ("torch_dist", "torch", "sharded", "etp", "etp_sharded"))
    train("straight", MOE_SAVING + ["--save", dist_dir], dist_dir)
    for name, flags in MOE_LOADING.items():
        saving = ["--save", etp_sharded_dir] if name.startswith("etp") else []
        train(name, flags + ["--load", dist_dir] + saving, dist_dir)
    train("same_layout", MOE_SAVING + ["--load", dist_dir], dist_dir)
    train("etp_straight", ETP_SAVING + ["--save", etp_dir], etp_dir)
    train("etp_other_layout", ETP_LOADING + ["--load", etp_dir], etp_dir)
    train("torch_straight", MOE_TORCH_SAVING + ["--ckpt-format", "torch", "--save", torch_dir], torch_dir)
    # Loads the torch format (either format loads) and saves iteration 4 as torch_dist from ZeRO-3 shards
    # cut over the expert-data-parallel group.
    train("torch_same_layout", MOE_TORCH_SAVING + ["--load", torch_dir, "--save", sharded_dir], sharded_dir)
    try:
        train_gpt(rank, world_size, MOE + MOE_FLAGS + MOE_LOADING["ep4-zero3"] + ["--load", torch_dir])
        out["torch_other_layout"] = None
    except CheckpointError as error:
        out["torch_other_layout"] = str(error)
    try:  # the torch format cuts experts over tp: refused at etp 2 with tp 1 before anything is read
        train_gpt(rank, world_size, MOE + MOE_FLAGS + ETP_LOADING + ["--load", torch_dir])
        out["torch_other_etp"] = None
    except CheckpointError as error:
        out["torch_other_etp"] = str(error)
    iteration = os.path.join(torch_dir, "iter_0000002")
    out["torch_files"] = sorted(f"{d}/{f}" for d in os.listdir(iteration) for f in os.listdir(f"{iteration}/{d}"))
    return out


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("moe"))
    results = run_distributed(moe_checkpoints, 4, root, timeout=900)
    names = ["straight", *MOE_LOADING, "same_layout", "etp_straight", "etp_other_layout", "torch_straight",
             "torch_same_layout"]
    merged = {name: merge_ranks([r[name] for r in results]) for name in names}
    for error in ("torch_other_layout", "torch_other_etp"):
        merged[error] = [r[error] for r in results]
    merged["torch_files"] = results[0]["torch_files"]
    merged["dirs"] = {"straight": os.path.join(root, "torch_dist"), "torch_same_layout": os.path.join(root, "sharded"),
                      "etp_straight": os.path.join(root, "etp"), ETP_ZERO1: os.path.join(root, "etp_sharded")}
    return merged


ETP_ZERO1 = "etp1-tp2-sp-ep2-zero1"


def continued_part(straight: dict) -> dict:
    """The straight run's iterations 3-4 (the ones a run resumed from iteration 2 logs)."""
    return dict(straight, losses=straight["losses"][2:], grad_norms=straight["grad_norms"][2:],
                moe_losses=straight["moe_losses"][2:])


@pytest.mark.parametrize("loading", list(MOE_LOADING))
def test_moe_torch_dist_checkpoint_continues_at_another_expert_layout(moe_runs, loading: str) -> None:
    from tests.distributed.test_moe_parallel import assert_same_router_losses

    straight, resumed = continued_part(moe_runs["straight"]), moe_runs[loading]
    assert len(resumed["losses"]) == 2
    assert_same_training(straight, resumed)
    assert_same_router_losses(straight, resumed, steps=2)


def test_moe_torch_dist_checkpoint_saved_at_etp1_continues_at_etp2(moe_runs) -> None:
    """Saved at tp2 + sp, etp 1, ep 2; continued at tp 1, etp 2, ep 1 with ZeRO-2 like its straight run."""
    from tests.distributed.test_moe_parallel import assert_same_router_losses

    straight, resumed = continued_part(moe_runs["etp_straight"]), moe_runs["etp_other_layout"]
    assert len(resumed["losses"]) == 2
    assert_same_training(straight, resumed)
    assert_same_router_losses(straight, resumed, steps=2)


def test_moe_checkpoints_resume_bitwise_at_the_same_expert_layout(moe_runs) -> None:
    for fmt in ("", "torch_"):
        straight, resumed = moe_runs[fmt + "straight"], moe_runs[fmt + "same_layout"]
        assert resumed["losses"] == straight["losses"][2:], fmt or "torch_dist"
        assert resumed["grad_norms"] == straight["grad_norms"][2:]
        assert resumed["moe_losses"] == straight["moe_losses"][2:]
        assert all(torch.equal(resumed["params"][k], v) for k, v in straight["params"].items())
    # Megatron-LM's legacy names: one directory per (tp, pp, ep) rank, a file per expert-data-parallel rank.
    assert moe_runs["torch_files"] == [f"mp_rank_00_000_00{e}/{f}" for e in (0, 1)
                                       for f in ("model_optim_rng.pt", "optim_rng_dp_001.pt")]


def test_moe_torch_dist_checkpoint_holds_every_expert_once_at_its_global_place(moe_runs) -> None:
    """The global tensors saved at iteration 4 (ep2 x tp2 without ZeRO; ep2 in dp4 from ZeRO-3 shards; etp 1 in
    tp2 without ZeRO and from ZeRO-1 shards) are the run's whole weights, [experts, ...] included, as the
    inference tools read them (load_full_state: generate, convert, the server, evaluate)."""
    from megatron_like.model.state import load_full_state

    for run, directory in moe_runs["dirs"].items():
        params = moe_runs[run]["params"]
        _, saved = load_full_state(directory, iteration=4)
        assert saved["layers.0.mlp.experts.weight1"].shape == (4, 64, 64)
        assert saved.keys() == params.keys(), run
        for name, tensor in params.items():
            torch.testing.assert_close(saved[name], tensor, rtol=0, atol=0, msg=f"{run}: {name}")


def test_moe_checkpoint_saved_at_etp1_loads_in_one_process_for_generation(moe_runs) -> None:
    """generate / the server / evaluate build their model at etp = tp from the etp 1 checkpoint: one process holds
    the straight run's weights (rows of the padded vocabulary both layouts have)."""
    from megatron_like.inference import load_inference_model
    from megatron_like.model.sharded_state import VOCAB_PARAMS
    from megatron_like.parallel_state import ParallelState

    loaded = load_inference_model(moe_runs["dirs"]["etp_straight"], ParallelState.single_process(torch.device("cpu")),
                                  iteration=4, with_tokenizer=False)
    assert loaded.config.parallel.expert_tensor_parallel_size is None  # the tool's own layout, not the saved etp 1
    params = moe_runs["etp_straight"]["params"]
    named = dict(loaded.model[0].named_parameters())
    assert named.keys() == params.keys()
    for name, tensor in named.items():
        rows = min(tensor.shape[0], params[name].shape[0]) if name in VOCAB_PARAMS else tensor.shape[0]
        torch.testing.assert_close(tensor[:rows], params[name][:rows], rtol=0, atol=0, msg=name)


def test_moe_torch_format_at_another_expert_layout_is_a_one_line_error(moe_runs) -> None:
    for message in moe_runs["torch_other_layout"]:
        assert message is not None and "\n" not in message
        assert "--expert-model-parallel-size 2, this run uses 4" in message and "checkpoint_reshard.py" in message
    for message in moe_runs["torch_other_etp"]:
        assert message is not None and "\n" not in message
        assert "torch-format checkpoint" in message and "this run uses 2" in message and "torch_dist" in message


# ------------------------------------------------------------------ DeepSeek routing: the expert bias resumes
# docs/moe.md: sigmoid, groups, expert bias, seq_aux_loss (test_moe_parallel.py's DEEPSEEK) at ep 2 in dp 2 with
# ZeRO-1; the bias is a buffer, so only the model's buffers carry it across the restart.
BIAS_LAYOUT = ["--expert-model-parallel-size", "2", "--zero-stage", "1", "--moe-token-dispatcher-type", "alltoall"]


def expert_bias_resumes(rank: int, world_size: int, root: str) -> dict:
    from tests.distributed.test_moe_parallel import DEEPSEEK, MOE

    out = {}
    for fmt in ("torch_dist", "torch"):
        directory = os.path.join(root, fmt)
        flags = MOE + DEEPSEEK + MOE_FLAGS + BIAS_LAYOUT + ["--ckpt-format", fmt]
        out[fmt + "straight"] = train_gpt(rank, world_size, flags + ["--save", directory])
        comm.barrier()
        if rank == 0:
            write_tracker(directory, 2)  # the straight run also saved iteration 4: resume from 2
        comm.barrier()
        out[fmt + "resumed"] = train_gpt(rank, world_size, flags + ["--load", directory])
    return out


def test_expert_bias_resumes_bitwise_in_both_formats(tmp_path) -> None:
    results = run_distributed(expert_bias_resumes, 2, str(tmp_path), timeout=600)
    for fmt in ("torch_dist", "torch"):
        straight, resumed = (merge_ranks([r[fmt + part] for r in results]) for part in ("straight", "resumed"))
        assert not straight["replica_mismatches"] and not resumed["replica_mismatches"]
        assert len(straight["expert_biases"]) == 4 and sorted(straight["expert_biases"][1]) == [1, 2, 3]
        assert any(b.abs().sum() > 0 for b in straight["expert_biases"][1].values())  # the bias to restore
        for step, (expected, got) in enumerate(zip(straight["expert_biases"][2:], resumed["expert_biases"],
                                                   strict=True)):
            assert all(torch.equal(expected[layer], got[layer]) for layer in expected), f"{fmt} iteration {step + 3}"
        assert resumed["losses"] == straight["losses"][2:], fmt
        assert resumed["moe_losses"] == straight["moe_losses"][2:], fmt
        assert all(torch.equal(resumed["params"][k], v) for k, v in straight["params"].items()), fmt


def assert_same_values(a, b, where) -> None:
    """Equal nested values (RNG states: lists, numbers and tensors), tensors bitwise."""
    if isinstance(a, dict):
        assert sorted(a) == sorted(b), where
        for key in a:
            assert_same_values(a[key], b[key], where)
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    else:
        assert a == b, where
