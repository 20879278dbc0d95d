"""In-training validation of the classification workflows draws a fixed, seeded shuffle of the validation set.

Image folders and label-sorted dev files list their samples class by class; the first ``--eval-iters`` batches
of an unshuffled stream then hold one class, and the printed accuracy says nothing (it printed 0.000 on
scikit-learn's digits).
"""

from __future__ import annotations

import numpy as np
import pytest

CLASSES, PER_CLASS = 10, 36


class ClassSorted:
    """``CLASSES * PER_CLASS`` samples, class 0 first, like an image folder or a label-sorted file."""

    def __len__(self) -> int:
        return CLASSES * PER_CLASS

    def __getitem__(self, index: int) -> dict:
        return {"index": index, "label": np.int64(index // PER_CLASS)}


def vit_streams(seed: int):
    import pretrain_vit
    from megatron_like.model.vit import VisionConfig

    return pretrain_vit.sample_streams(ClassSorted(), ClassSorted(), VisionConfig(num_classes=CLASSES), seed,
                                       (640, 3 * CLASSES * PER_CLASS, 0))


def classification_streams(seed: int):
    import finetune_gpt_classification

    return finetune_gpt_classification.sample_streams(ClassSorted(), ClassSorted(), seed,
                                                      (640, 3 * CLASSES * PER_CLASS, 0))


@pytest.mark.parametrize("streams", [vit_streams, classification_streams], ids=["vit", "classification"])
def test_validation_is_a_fixed_seeded_shuffle(streams):
    _, valid, test = streams(1234)
    assert test is None
    n = CLASSES * PER_CLASS
    first_eval = [int(valid[i]["label"]) for i in range(32)]  # --eval-iters 1 at global batch 32
    assert len(set(first_eval)) >= CLASSES // 2, first_eval
    epoch = sorted(valid[i]["index"] for i in range(n))
    assert epoch == list(range(n))  # every validation sample once per pass
    again = [valid[i]["index"] for i in range(len(valid))]
    assert again == [streams(1234)[1][i]["index"] for i in range(len(valid))]  # fixed by the seed
    assert again != [streams(1235)[1][i]["index"] for i in range(len(valid))]
