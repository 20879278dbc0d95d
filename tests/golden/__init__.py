"""Golden loss curves: per-iteration losses of fixed-seed tiny runs, stored in this directory.

They catch changes that move every parallel layout together, which the equivalence tests cannot see
(initialization, data order, lr schedule, loss). After an intended change of that kind, regenerate
the files on purpose and commit them with the change::

    PYTHONPATH=. .venv/bin/python -m tests.golden.regenerate

The runs are defined in ``tests/golden/runs.py``; ``tests/golden/test_golden_curves.py`` compares.
"""
