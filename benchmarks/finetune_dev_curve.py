"""``finetune_gpt_classification.py`` whose in-training validation is the whole dev set: a dev accuracy curve.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/finetune_dev_curve.py <finetune_gpt_classification.py flags> \\
        --eval-interval 20 --eval-iters 1

The fine-tune's own validation (``--eval-interval``, ``--eval-iters``) reads ``--eval-iters`` global batches of a
reshuffled dev stream: a sample, which is what a long fine-tune wants. To compare a learning curve with the plain
fine-tune's (``benchmarks/plain_gpt_classification.py --eval-interval``, which evaluates all of the dev set), this
script replaces each of those validations by an exact pass over every dev example (``tasks.evaluation``), printed
as ``dev set at iteration N: ...`` on the last pipeline stage; ``--eval-iters`` must be positive for the loop to
validate at all (1 is enough: the batches it draws are not read). Training is untouched (seed 1234's runs with
it reproduce those without it to the digit). ``benchmarks/learning_quality.py finetune`` runs ours through it
(issue 32 item 4).
"""

from __future__ import annotations

import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import finetune_gpt_classification as task  # noqa: E402
from megatron_like.training import loop  # noqa: E402
from tasks.common import print_last_rank  # noqa: E402
from tasks.evaluation import evaluate_dataset  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    streams, dev_sets, evaluation_number = task.sample_streams, [], itertools.count(1)

    def sample_streams(train, dev, seed, num_samples):
        dev_sets.append(dev)
        return streams(train, dev, seed, num_samples)

    def whole_dev(config, ps, forward_step_func, data_iterator, model, num_batches):
        iteration = next(evaluation_number) * config.logging.eval_interval  # the loop validates at its multiples
        dev = dev_sets[-1]
        metrics = evaluate_dataset(config, ps, model, task.eval_forward_step, dev, binary=False)
        if metrics:
            print_last_rank(f" dev set at iteration {iteration}: {int(metrics['samples'])} examples | accuracy: "
                            f"{100 * metrics['accuracy']:.2f} | loss: {metrics['loss']:.6E} |")
        return {}  # nothing for the loop's own validation line

    task.sample_streams = sample_streams
    loop.evaluate = whole_dev
    task.main(argv)


if __name__ == "__main__":
    main()
