"""The documented workflow commands learn (one process, in this process for speed; the parallel layouts are
proven equal to one process in tests/distributed/test_vit_classification_qat_parallel.py).

* ViT on the generated image folder (``data_tools/make_image_dataset.py``): the loss falls and the
  top-1 accuracy on the validation folder is far above chance (4 classes: 25%).
* GPT classification on the generated MRPC-like set (``data_tools/make_mrpc_like.py``), starting from a
  ``pretrain_gpt.py --save`` checkpoint: dev accuracy and F1 far above chance (50%).
"""

from __future__ import annotations

import re

LOSS = re.compile(r"^ iteration .*\| loss: ([0-9.E+-]+) \|", re.MULTILINE)
COMMON = ["--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0", "--log-interval", "5"]


def logged_losses(text: str) -> list[float]:
    return [float(m) for m in LOSS.findall(text)]


def test_vit_learns_on_generated_image_folder(tmp_path, capsys):
    import pretrain_vit
    from megatron_like.data.image_folder import write_image_folder  # what data_tools/make_image_dataset.py runs

    write_image_folder(str(tmp_path / "images"), "train", 320, image_size=12, seed=1)
    write_image_folder(str(tmp_path / "images"), "val", 96, image_size=12, seed=2)
    pretrain_vit.main(COMMON + [
        "--data-path", str(tmp_path / "images"), "--image-size", "12", "--patch-size", "4", "--num-layers", "2",
        "--hidden-size", "32", "--num-attention-heads", "4", "--micro-batch-size", "16", "--global-batch-size", "16",
        "--train-iters", "80", "--lr", "3e-3", "--eval-interval", "80", "--eval-iters", "2",
    ])
    out = capsys.readouterr().out
    losses = logged_losses(out)
    # 80 iterations: since the position table starts at std 1/sqrt(h) (0.18 at h 32), these orientation-only
    # stripes need ~30 more iterations than at 0.02 (53% top-1 at iteration 50, 78% at 80).
    assert len(losses) == 16 and losses[-1] < 0.7 * losses[0], losses
    accuracy = float(re.search(r"validation set: 96 images \| top-1 accuracy: ([0-9.]+)", out).group(1))
    assert accuracy > 60.0, out


def test_gpt_classification_learns_from_pretrained_checkpoint(tmp_path, capsys):
    import finetune_gpt_classification
    import pretrain_gpt
    from data_tools.make_mrpc_like import main as make_pairs

    make_pairs(["--output-dir", str(tmp_path / "mrpc"), "--train", "256", "--dev", "64"])
    vocab = int(re.search(r"word-level tokenizer of (\d+) tokens", capsys.readouterr().out).group(1))
    model = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
             "--max-position-embeddings", "32", "--make-vocab-size-divisible-by", "8"]
    pretrain_gpt.main(COMMON + model + ["--mock-data", "--vocab-size", str(vocab), "--train-iters", "2",
                                        "--save", str(tmp_path / "gpt"), "--eval-iters", "0"])
    finetune_gpt_classification.main(COMMON + model + [
        "--pretrained-checkpoint", str(tmp_path / "gpt"), "--train-data", str(tmp_path / "mrpc" / "train.tsv"),
        "--valid-data", str(tmp_path / "mrpc" / "dev.tsv"), "--tokenizer-type", "HuggingFaceTokenizer",
        "--tokenizer-model", str(tmp_path / "mrpc" / "tokenizer.json"), "--epochs", "3", "--micro-batch-size", "16",
        "--global-batch-size", "16", "--lr", "2e-3", "--scale-lr-by-world-size", "--eval-interval", "100",
        "--eval-iters", "1",
    ])
    out = capsys.readouterr().out
    assert "loaded GPT body" in out and "initialized: ['head_weight']" in out
    assert "fine-tuning on 256 examples for 48 iterations of 16" in out  # 3 epochs in batches of 16
    found = re.search(r"dev set: 64 examples \| accuracy: ([0-9.]+) \| F1: ([0-9.]+)", out)
    assert found, out
    accuracy, f1 = float(found.group(1)), float(found.group(2))
    assert accuracy > 80.0 and f1 > 75.0, out
