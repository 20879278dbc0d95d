"""Deterministic synthetic token sequences for ``--mock-data`` runs and tests.

Sample ``i`` is an arithmetic progression modulo the vocabulary whose start (in the lowest eighth of the
vocabulary) and stride (1 to 3) come from a generator seeded by ``(seed, i)``. The skewed token
frequencies make the loss fall within a few steps; predicting the stride from context rewards longer
training. Any rank can build any sample without coordination.
"""

from __future__ import annotations

import numpy as np


class MockGPTDataset:
    """``len(ds) == num_samples``; ``ds[i] == {"text": int64 array [seq_length + 1]}``."""

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int) -> None:
        if vocab_size < 2:
            raise ValueError(f"mock data needs a vocabulary of at least 2 tokens, got {vocab_size}")
        self.num_samples, self.seq_length = num_samples, seq_length
        self.vocab_size, self.seed = vocab_size, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range [0, {self.num_samples})")
        rng = np.random.default_rng([self.seed, index])
        start = int(rng.integers(max(1, self.vocab_size // 8)))
        stride = int(rng.integers(1, 4))
        tokens = (start + stride * np.arange(self.seq_length + 1, dtype=np.int64)) % self.vocab_size
        return {"text": tokens}
