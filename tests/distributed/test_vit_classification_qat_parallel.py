"""The seed workflows trained in parallel equal the single-process run (losses, grad norms, weights, metrics).

One 4-process group runs, one after the other: ViT at tp=2 x pp=2 (also with dropout on, where the tp ranks must
still hold one model) and at tp=2 + sequence parallel x dp=2,
GPT sequence classification at pp=2 x dp=2 with ZeRO-1 (``--use-distributed-optimizer``) and the lr scaled
by the world size, and QAT GPT at tp=2 x pp=2 (compared code by code, see tests/distributed/qat_record.py).
The references run in the test process.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.distributed.gpt_runs import TRAIN_ITERS, assert_same_training, full_parameters, merge_ranks, train_gpt
from tests.distributed.harness import run_distributed
from tests.distributed.qat_record import GRID_ATOL, QuantizerRecorder, codes, merge_records, replay

NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0", "--seed", "1234",
              "--log-interval", "1", "--adam-eps", "1e-5"]
VIT_FLAGS = NO_DROPOUT + [
    "--mock-data", "--image-size", "12", "--patch-size", "4", "--num-layers", "2", "--hidden-size", "32",
    "--num-attention-heads", "4", "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "3",
    "--lr", "1e-3", "--eval-interval", "3", "--eval-iters", "1",
]
CLS_MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
             "--max-position-embeddings", "32"]
TP, PP, SP = "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--sequence-parallel"
# QAT at lr 0: every step quantizes the same weights, so a code that differs between the runs is a rounding
# flip of this step, not drift. With lr > 0 Adam's first, sign-like step turns the gradient change of one
# flip into weight differences of up to 2 lr, several weight quantization steps, and the runs part by
# design (measured in docs/workflows.md); the optimizer under tp x pp is proven by the float tests.
QAT_FLAGS = ["--qat", "--lr", "0"]
QAT_LINEARS = ("attention.qkv", "attention.proj", "mlp.fc1", "mlp.fc2")
QAT_LAYERS, QAT_ITERS, QAT_MICRO_BATCHES = 4, TRAIN_ITERS, 4  # gpt_runs.BASE_FLAGS: 4 layers, TRAIN_ITERS, 8 / 2


def vit_run(flags: list[str], world_size: int) -> dict:
    import pretrain_vit
    from megatron_like.parallel_state import ParallelState

    config, vision = pretrain_vit.build_config(VIT_FLAGS + flags)
    ps = ParallelState.initialize(config.parallel, world_size)
    result, metrics = pretrain_vit.train_vit(config, vision, ps)
    return {"losses": result.losses, "grad_norms": result.grad_norms, "params": full_parameters(result.model, ps),
            "metrics": metrics, "validation": result.validation_stats}


def classification_flags(data: dict[str, str]) -> list[str]:
    return NO_DROPOUT + CLS_MODEL + [
        "--pretrained-checkpoint", data["checkpoint"], "--train-data", data["train"], "--valid-data", data["dev"],
        "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", data["tokenizer"],
        "--make-vocab-size-divisible-by", "8", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--eval-interval", "4", "--eval-iters", "1",
    ]


def classification_run(flags: list[str], world_size: int) -> dict:
    import finetune_gpt_classification as task
    from megatron_like.parallel_state import ParallelState

    config, cls_config = task.build_config(flags)
    ps = ParallelState.initialize(config.parallel, world_size)
    out = task.finetune(config, cls_config, ps)
    return {"losses": out.training.losses, "grad_norms": out.training.grad_norms,
            "params": full_parameters(out.training.model, ps), "metrics": out.dev_metrics, "lr": config.optimizer.lr}


def qat_run(rank: int, world_size: int, flags: list[str]) -> dict:
    """train_gpt with --qat at lr 0, every quantizer call recorded (dL/dy too in one process)."""
    recorder = QuantizerRecorder(grads=world_size == 1)
    result = train_gpt(rank, world_size, flags + QAT_FLAGS, on_chunk=recorder.attach)
    return {**result, "records": recorder.records}


def parallel_bundle(rank: int, world_size: int, data: dict[str, str]) -> dict:
    return {
        "vit-tp2-pp2": vit_run([TP, "2", PP, "2"], world_size),
        "vit-tp2-sp-dp2": vit_run([TP, "2", SP], world_size),
        "vit-tp2-pp2-dropout": vit_run([TP, "2", PP, "2", "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
                                        "--dropout-rng", "megatron"], world_size),
        "cls-pp2-dp2-zero1": classification_run(
            classification_flags(data) + [PP, "2", "--use-distributed-optimizer", "--train-iters", "4", "--lr",
                                          "2.5e-4", "--scale-lr-by-world-size"], world_size),
        "qat-tp2-pp2": qat_run(rank, world_size, [TP, "2", PP, "2"]),
    }


def merge(results: list[dict]) -> dict:
    merged = merge_ranks(results)
    merged["metrics"] = [r["metrics"] for r in results if r.get("metrics")]
    if "records" in results[0]:
        merged["records"] = merge_records([r["records"] for r in results])
    return merged


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, str]:
    """Generated MRPC-like files, their word tokenizer, and a GPT pretrained for 2 steps on its vocabulary."""
    import pretrain_gpt
    from data_tools.make_mrpc_like import generate, write, write_word_tokenizer
    from megatron_like.config import parse_config
    from megatron_like.training import pretrain

    root = tmp_path_factory.mktemp("workflows")
    train, dev = generate(64, 1), generate(32, 2)
    paths = {"train": str(root / "train.tsv"), "dev": str(root / "dev.jsonl"), "tokenizer": str(root / "tok.json"),
             "checkpoint": str(root / "gpt")}
    write(paths["train"], train)
    write(paths["dev"], dev)
    vocab = write_word_tokenizer(paths["tokenizer"], train + dev)
    config = parse_config(NO_DROPOUT + CLS_MODEL + [
        "--mock-data", "--vocab-size", str(vocab), "--make-vocab-size-divisible-by", "8", "--train-iters", "2",
        "--micro-batch-size", "4", "--save", paths["checkpoint"], "--eval-iters", "0"], world_size=1)
    padded = config.padded_vocab_size(vocab)
    pretrain(config, functools.partial(pretrain_gpt.model_provider, padded_vocab_size=padded),
             pretrain_gpt.forward_step, pretrain_gpt.datasets_provider, padded_vocab_size=padded)
    return paths


@pytest.fixture(scope="module")
def parallel(data) -> dict[str, dict]:
    results = run_distributed(parallel_bundle, 4, data)
    return {name: merge([r[name] for r in results]) for name in results[0]}


@functools.cache
def vit_reference() -> dict:
    return merge([vit_run([], 1)])


def test_vit_tp_ranks_keep_one_model_with_dropout(parallel):
    """Dropout on, Megatron's streams (``--dropout-rng megatron``; pretrain_vit.py's default, layout-independent, is
    proved equal to one process in tests/e2e/test_cli_dropout_layouts.py): no layout equals one process (head
    shards draw their masks per tp rank), but every replicated
    parameter (class token, positions, patch projection, LayerNorms, row-parallel biases, head) must stay bitwise
    the same on the tp ranks of a stage. Replicated activations drop the same elements on each tp rank (the
    default generator, shared by the tp group); a hidden-dropout mask drawn per tp rank would feed the ranks
    different residual streams, and their replicated weights would part after one step."""
    run = parallel["vit-tp2-pp2-dropout"]
    assert run["losses"] != parallel["vit-tp2-pp2"]["losses"]  # dropout was on
    assert min(run["copies"].values()) == 2  # every parameter compared across the two tp ranks of its stage
    assert not run["replica_mismatches"], run["replica_mismatches"]


@pytest.mark.parametrize("name", ["vit-tp2-pp2", "vit-tp2-sp-dp2"])
def test_vit_parallel_equals_single_process(parallel, name):
    reference = vit_reference()
    # Clipping (--clip-grad 1.0) scales every compared step, so the global norm over tp x pp and the clip factor
    # applied on every rank are part of what must equal one process.
    assert min(reference["grad_norms"]) > 1.0, reference["grad_norms"]
    assert_same_training(reference, parallel[name])
    for metrics in parallel[name]["metrics"]:
        assert metrics["samples"] == reference["metrics"][0]["samples"] == 256
        assert metrics["accuracy"] == pytest.approx(reference["metrics"][0]["accuracy"], abs=1e-6)
        assert metrics["loss"] == pytest.approx(reference["metrics"][0]["loss"], rel=1e-5)


def test_classification_pp2_zero1_equals_single_process(parallel, data):
    reference = merge([classification_run(classification_flags(data) + [
        "--train-iters", "4", "--lr", "1e-3", "--scale-lr-by-world-size"], 1)])
    result = parallel["cls-pp2-dp2-zero1"]
    assert_same_training(reference, result)
    assert len(result["metrics"]) == 2  # the two dp ranks of the last stage
    for metrics in result["metrics"]:
        assert metrics["samples"] == 32
        for key in ("accuracy", "f1", "loss"):
            assert metrics[key] == pytest.approx(reference["metrics"][0][key], rel=1e-5, abs=1e-6)


def test_qat_tp2_pp2_quantizes_as_single_process(parallel):
    """Exact per quantizer call, bounded by the quantization step for the loss (tests/distributed/qat_record.py)."""
    reference, result = merge([qat_run(0, 1, [])]), parallel["qat-tp2-pp2"]
    ref, par = reference["records"], result["records"]
    expected = {f"layers.{i}.{linear}.{kind}" for i in range(QAT_LAYERS) for linear in QAT_LINEARS
                for kind in ("input", "weight")}
    assert set(ref) == set(par) == expected, "a transformer linear is not fake-quantized"
    assert all(len(calls) == QAT_ITERS * QAT_MICRO_BATCHES for records in (ref, par) for calls in records.values())

    # Exact: each parallel call quantizes its gathered full tensor as one process would (full-row scales),
    # every value is an int8 code times its scale, and at lr 0 the weight codes are one process's.
    for key, calls in par.items():
        for i, call in enumerate(calls):
            assert torch.equal(replay(key, call)[0], call["y"]), f"{key} call {i}: not one process's quantization"
    for records in (ref, par):
        for key, calls in records.items():
            for call in calls:
                code, _ = codes(key, call)
                assert (code - code.round()).abs().max() <= GRID_ATOL, f"{key}: output is not on the int8 grid"
                assert code.abs().max() <= 127 + GRID_ATOL
    for key in (k for k in expected if k.endswith(".weight")):
        assert all(torch.equal(a["y"], b["y"]) for a, b in zip(ref[key], par[key])), key

    # Bounded: float noise plus the first-order worth of the quantized activations that differ.
    inputs = sorted(k for k in expected if k.endswith(".input"))
    for step, (loss, expected_loss) in enumerate(zip(result["losses"], reference["losses"])):
        calls = slice(step * QAT_MICRO_BATCHES, (step + 1) * QAT_MICRO_BATCHES)
        pairs = [(a, b, key) for key in inputs for a, b in zip(ref[key][calls], par[key][calls])]
        worth = sum(float((a["grad"] * (b["y"] - a["y"])).abs().sum()) for a, b, _ in pairs)
        flips = [(codes(key, b)[0].round() - codes(key, a)[0].round()).abs() for a, b, key in pairs]
        measured = (f"step {step + 1}: {sum(int((f > 0).sum()) for f in flips)} of {sum(f.numel() for f in flips)} "
                    f"activation codes differ, by at most {max(int(f.max()) for f in flips)}; their worth {worth:.2e}")
        print(measured, f"loss difference {abs(loss - expected_loss):.2e}")
        assert abs(loss - expected_loss) <= 1e-5 * abs(expected_loss) + worth, (loss, expected_loss, measured)
    # Step 1 starts both runs from the same weights and unset ranges, so only reduction-order flips separate
    # them (20 codes measured). From step 2 the ranges (moving averages) carry those flips into every code's
    # scale, which the loss bound above accounts for and a gradient norm has no such bound for.
    assert result["grad_norms"][0] == pytest.approx(reference["grad_norms"][0], rel=1e-4)
    amax = {k: v for k, v in result["params"].items() if "quantizer" in k}
    assert not amax  # quantizer ranges are buffers, not parameters: the weights above are all there is
