"""Write a small generated image-classification set as an image folder (PNG files; needs Pillow).

    python data_tools/make_image_dataset.py --output-dir data/images --train 2000 --val 400 --image-size 32

Layout: ``<output-dir>/{train,val}/<class>/<index>.png`` with four classes of striped images (horizontal,
vertical, diagonal, anti-diagonal; random period, phase, colour and noise), the layout ``pretrain_vit.py
--data-path`` reads. The generator is ``megatron_like.data.image_folder.synthetic_image`` (``--mock-data``
draws the same kind of images in memory). Output is deterministic for a given ``--seed``.
"""

from __future__ import annotations

import os

import _common  # noqa: F401 - puts the repo on sys.path when run from a checkout

from megatron_like.config import QuietArgumentParser
from megatron_like.data.image_folder import write_image_folder


def main(argv: list[str] | None = None) -> None:
    parser = QuietArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--train", type=int, default=2000, help="training images")
    parser.add_argument("--val", type=int, default=400, help="validation images")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    for split, count, seed in (("train", args.train, args.seed), ("val", args.val, args.seed + 1)):
        write_image_folder(args.output_dir, split, count, args.image_size, seed)
        print(f"wrote {count} images of {args.image_size}x{args.image_size} to {os.path.join(args.output_dir, split)}")


if __name__ == "__main__":
    main()
