"""data_tools/make_digits_dataset.py writes scikit-learn's bundled digits as the image folder pretrain_vit.py reads.

scikit-learn is in the ``test`` extra (scripts/setup.sh installs it), so this runs everywhere the suite runs.
"""

from __future__ import annotations

import numpy as np

from tests.e2e.cli import run_data_tool


def test_digits_folder_is_a_seeded_stratified_split_of_every_digit(tmp_path):
    from sklearn.datasets import load_digits

    from megatron_like.data.image_folder import ImageFolderDataset

    run_data_tool("make_digits_dataset.py", "--output-dir", tmp_path / "a")
    train = ImageFolderDataset(str(tmp_path / "a" / "train"), image_size=32)
    val = ImageFolderDataset(str(tmp_path / "a" / "val"), image_size=32, classes=train.classes)
    assert train.classes == [str(d) for d in range(10)]
    assert len(train) + len(val) == 1797 and abs(len(val) - 0.2 * 1797) < 10
    val_counts = np.bincount([label for _, label in val.samples], minlength=10)
    assert val_counts.min() >= 30, val_counts  # every digit in both splits, about 20% of each
    names = {path.rsplit("/", 1)[1] for path, _ in train.samples + val.samples}
    assert len(names) == 1797  # each source digit written once

    # The pixels are the source digit, 0-16 scaled to [-1, 1], each pixel a 4x4 block, the same in every channel.
    digits = load_digits()
    path, label = val.samples[7]
    index = int(path.rsplit("/", 1)[1].split(".")[0])
    image = val[7]["image"]  # (3, 32, 32)
    assert label == digits.target[index]
    expected = np.round(digits.images[index] * 255 / 16) / 127.5 - 1
    np.testing.assert_allclose(image[:, ::4, ::4], np.broadcast_to(expected, (3, 8, 8)), atol=1e-6)
    np.testing.assert_array_equal(image[:, 1::4, 2::4], image[:, ::4, ::4])

    # The split is the tool's seeded one, the same on every call.
    from data_tools.make_digits_dataset import split_indices

    train_ids, val_ids = split_indices(digits.target, 0.2, 1234)
    assert sorted(int(p.rsplit("/", 1)[1].split(".")[0]) for p, _ in val.samples) == val_ids.tolist()
    np.testing.assert_array_equal(split_indices(digits.target, 0.2, 1234)[0], train_ids)
    bad = run_data_tool("make_digits_dataset.py", "--output-dir", tmp_path / "c", "--image-size", "30", check=False)
    assert bad.returncode != 0 and "--image-size 30 must be a positive multiple of 8" in bad.stderr
