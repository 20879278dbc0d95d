"""``finetune_gpt_classification.py`` with the head drawn as ``nn.Linear``'s default weight, U(+-1/sqrt(h)), instead
of N(0, --init-method-std^2): does our head's start explain the fine-tune's gap to the plain one (issue 32 item 4)?

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/finetune_head_init.py <finetune_gpt_classification.py flags>

One process only (the head is redrawn whole, from a generator of ``--seed``); the bias ``nn.Linear`` would add is not
(ours has none). Results: docs/performance.md, "Sequence-classification fine-tune against a plain reference".
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import finetune_gpt_classification as task  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    build = task.model_provider

    def model_provider(config, ps, **kwargs):
        chunk = build(config, ps, **kwargs)
        if chunk.post_process:
            bound = chunk.head_weight.shape[1] ** -0.5
            generator = torch.Generator().manual_seed(config.training.seed)
            with torch.no_grad():
                chunk.head_weight.copy_(torch.rand(chunk.head_weight.shape, generator=generator) * 2 * bound - bound)
        return chunk

    task.model_provider = model_provider
    task.main(argv)


if __name__ == "__main__":
    main()
