"""``pretrain_vit.py`` with other dropout masks only: the same initial weights and sample order as ``--seed`` gives,
the dropout streams seeded by ``--seed`` + ``--dropout-offset``. Is a seed's result its draw of weights and order,
or the draw of its dropout masks? (Issue 32: seed 1234 reached 66.57% at tp2 x pp2 and 86.35% in one process.)

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/vit_dropout_stream.py --dropout-offset 1 \\
        <pretrain_vit.py flags: the README recipe, --data-path runs/learning_quality/digits, --seed 1234>
    OMP_NUM_THREADS=1 .venv/bin/python -m torch.distributed.run --standalone --nproc_per_node=4 \\
        benchmarks/vit_dropout_stream.py --dropout-offset 1 <the same flags> \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2

The weights are drawn from generators of ``--seed`` and each weight's name, the samples are shuffled from
``--seed``; only the dropout streams (``seed_everything``, which the training loop calls once: the default generator
and the tensor-parallel stream of ``--dropout-rng megatron``, the dropout sites of ``layout-independent``, the ViT's
default) see the offset. Offset 0 is ``pretrain_vit.py`` itself. Results: docs/performance.md, "Learning quality
against plain PyTorch" (the figures there predate ``layout-independent``: they were drawn from Megatron's streams).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pretrain_vit  # noqa: E402
from megatron_like.tensor_parallel import random as tp_random  # noqa: E402
from megatron_like.training import loop  # noqa: E402


def shift_dropout_streams(offset: int) -> None:
    """Make the training loop seed its dropout streams with ``seed + offset`` (weights and data keep ``seed``)."""

    def seed_everything(seed: int, tp_rank: int, pp_rank: int, device_type: str = "cpu") -> None:
        tp_random.seed_everything(seed + offset, tp_rank, pp_rank, device_type)

    loop.seed_everything = seed_everything


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dropout-offset", type=int, required=True, help="added to --seed for the dropout streams")
    args, rest = parser.parse_known_args(argv)
    shift_dropout_streams(args.dropout_offset)
    pretrain_vit.main(rest)


if __name__ == "__main__":
    main()
