"""The seed workflows trained in parallel equal the single-process run (losses, grad norms, weights, metrics).

One 4-process group runs, one after the other: ViT at tp=2 x pp=2 and at tp=2 + sequence parallel x dp=2,
GPT sequence classification at pp=2 x dp=2 with ZeRO-1 (``--use-distributed-optimizer``) and the lr scaled
by the world size, and QAT GPT at tp=2 x pp=2. The references run in the test process.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.distributed.gpt_runs import assert_same_training, full_parameters, merge_ranks, train_gpt
from tests.distributed.harness import run_distributed

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


def parallel_bundle(rank: int, world_size: int, data: dict[str, str]) -> dict:
    return {
        "vit-tp2-pp2": vit_run([TP, "2", PP, "2"], world_size),
        "vit-tp2-sp-dp2": vit_run([TP, "2", SP], world_size),
        "cls-pp2-dp2-zero1": classification_run(
            classification_flags(data) + [PP, "2", "--use-distributed-optimizer", "--train-iters", "4", "--lr",
                                          "2.5e-4", "--scale-lr-by-world-size"], world_size),
        "qat-tp2-pp2": train_gpt(rank, world_size, [TP, "2", PP, "2", "--qat"]),
    }


def merge(results: list[dict]) -> dict:
    merged = merge_ranks(results)
    merged["metrics"] = [r["metrics"] for r in results if r.get("metrics")]
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


@pytest.mark.parametrize("name", ["vit-tp2-pp2", "vit-tp2-sp-dp2"])
def test_vit_parallel_equals_single_process(parallel, name):
    reference = vit_reference()
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


def test_qat_tp2_pp2_equals_single_process(parallel):
    reference = merge_ranks([train_gpt(0, 1, ["--qat"])])
    assert_same_training(reference, parallel["qat-tp2-pp2"])
    amax = {k: v for k, v in parallel["qat-tp2-pp2"]["params"].items() if "quantizer" in k}
    assert not amax  # quantizer ranges are buffers, not parameters: the weights above are all there is
    assert torch.isfinite(torch.tensor(reference["losses"])).all()
