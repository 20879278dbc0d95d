"""Image classification data: image folders (torchvision's ``ImageFolder`` layout) and a generated set.

Folder layout, one sub-folder per class (class index = position in the sorted folder names)::

    <root>/train/<class name>/<any name>.png|.jpg|...
    <root>/val/<class name>/...

Images are read with Pillow (imported only here, when a folder is read), converted to RGB or grayscale,
resized to ``image_size`` and scaled to ``[-1, 1]``. A sample is
``{"image": float32 [c, image_size, image_size], "label": int64 []}``.

The generated set (:func:`synthetic_image`) draws stripes whose orientation is the class (horizontal,
vertical, diagonal, anti-diagonal) with a random period, phase, colour and noise: separable, but only by
looking at the pixels of a patch together. ``data_tools/make_image_dataset.py`` writes it as a folder.
"""

from __future__ import annotations

import os

import numpy as np

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".ppm", ".webp")
SYNTHETIC_CLASSES = ("horizontal", "vertical", "diagonal", "antidiagonal")


def synthetic_image(index: int, seed: int, image_size: int, num_channels: int = 3) -> tuple[np.ndarray, int]:
    """Generated image ``index``: uint8 ``[image_size, image_size, num_channels]`` and its class (0-3)."""
    rng = np.random.default_rng([seed, index])
    label = int(rng.integers(len(SYNTHETIC_CLASSES)))
    rows, cols = np.mgrid[0:image_size, 0:image_size].astype(np.float64)
    coordinate = (rows, cols, rows + cols, rows - cols)[label]
    period = rng.uniform(3.0, 6.0)
    wave = np.sin(2 * np.pi * coordinate / period + rng.uniform(0, 2 * np.pi))  # (H, W) in [-1, 1]
    colour = rng.uniform(0.3, 1.0, size=num_channels)
    pixels = 0.5 + 0.5 * wave[..., None] * colour + rng.normal(0.0, 0.1, size=(image_size, image_size, num_channels))
    return (np.clip(pixels, 0.0, 1.0) * 255).astype(np.uint8), label


def to_model_input(pixels: np.ndarray) -> np.ndarray:
    """uint8 ``[H, W, c]`` -> float32 ``[c, H, W]`` in ``[-1, 1]``."""
    return (pixels.astype(np.float32) / 127.5 - 1.0).transpose(2, 0, 1).copy()


class SyntheticImageDataset:
    """``num_samples`` generated images (see :func:`synthetic_image`); any rank builds any sample alone."""

    def __init__(self, num_samples: int, image_size: int, num_channels: int, seed: int) -> None:
        self.num_samples, self.image_size, self.num_channels, self.seed = num_samples, image_size, num_channels, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        pixels, label = synthetic_image(index, self.seed, self.image_size, self.num_channels)
        return {"image": to_model_input(pixels), "label": np.int64(label)}


def class_folders(root: str) -> list[str]:
    """Sorted class sub-folder names of ``root`` (an error names the folder when there are none)."""
    if not os.path.isdir(root):
        raise FileNotFoundError(f"image folder {root} does not exist (expected <root>/<class>/<image files>)")
    classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    if not classes:
        raise ValueError(f"image folder {root} holds no class sub-folders")
    return classes


class ImageFolderDataset:
    """Images under ``root/<class>/``: ``{"image": float32 [c, s, s], "label": int64 []}`` (s = image_size)."""

    def __init__(self, root: str, image_size: int, num_channels: int = 3, classes: list[str] | None = None) -> None:
        self.root, self.image_size, self.num_channels = root, image_size, num_channels
        self.classes = classes if classes is not None else class_folders(root)
        self.samples: list[tuple[str, int]] = []
        for label, name in enumerate(self.classes):
            folder = os.path.join(root, name)
            if not os.path.isdir(folder):
                continue  # a class absent from this split
            for file in sorted(os.listdir(folder)):
                if file.lower().endswith(IMAGE_EXTENSIONS):
                    self.samples.append((os.path.join(folder, file), label))
        if not self.samples:
            raise ValueError(f"image folder {root} holds no images ({', '.join(IMAGE_EXTENSIONS)})")

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        from PIL import Image

        path, label = self.samples[index]
        with Image.open(path) as image:
            image = image.convert("RGB" if self.num_channels == 3 else "L")
            if image.size != (self.image_size, self.image_size):
                image = image.resize((self.image_size, self.image_size), Image.BILINEAR)
            pixels = np.asarray(image, dtype=np.uint8)
        if pixels.ndim == 2:
            pixels = pixels[..., None]
        return {"image": to_model_input(pixels), "label": np.int64(label)}


def write_image_folder(root: str, split: str, num_images: int, image_size: int, seed: int) -> None:
    """Write ``num_images`` generated images as PNG files under ``root/split/<class>/`` (needs Pillow)."""
    from PIL import Image

    for name in SYNTHETIC_CLASSES:
        os.makedirs(os.path.join(root, split, name), exist_ok=True)
    for index in range(num_images):
        pixels, label = synthetic_image(index, seed, image_size)
        path = os.path.join(root, split, SYNTHETIC_CLASSES[label], f"{index:06d}.png")
        Image.fromarray(pixels, mode="RGB").save(path)
