"""The arrays behind GPT samples and blending, with Megatron-LM's semantics (legacy ``gpt_dataset.py``).

- ``doc_idx``    int32 [epochs * docs]: the split's document ids repeated per epoch, shuffled.
- ``sample_idx`` int32/int64 [num_samples + 1, 2]: (position in doc_idx, token offset) where sample i
  starts; sample i spans up to and including the start of sample i + 1 (``seq_length + 1`` tokens, a
  one-token overlap).
- ``shuffle_idx`` uint32/int64 [num_samples]: the order samples are served in.
- blending: ``dataset_index`` int16 [size] and ``dataset_sample_index`` int64 [size] from the greedy rule
  ``argmax_d(w_d * max(i, 1) - count_d)``.

``build_sample_idx`` and ``build_blending_indices`` use the C++ helpers in ``csrc/dataset_helpers.cpp``
(``megatron_like._csrc.dataset_helpers``) when built, else the numpy code here; set
``MEGATRON_LIKE_NO_CSRC=1`` to force the numpy code. Both give identical arrays.
"""

from __future__ import annotations

import os
import warnings

import numpy as np

_CSRC_UNSET = object()
_csrc_module = _CSRC_UNSET


def csrc_helpers():
    """Return the compiled ``dataset_helpers`` module, or None when absent or disabled by the env."""
    global _csrc_module
    if os.environ.get("MEGATRON_LIKE_NO_CSRC", "0") not in ("", "0"):
        return None
    if _csrc_module is _CSRC_UNSET:
        try:
            from megatron_like._csrc import dataset_helpers
        except ImportError:
            dataset_helpers = None
            warnings.warn(
                "megatron_like._csrc.dataset_helpers is not built (pip install -e .); using the numpy "
                "fallback for dataset indices",
                stacklevel=2,
            )
        _csrc_module = dataset_helpers
    return _csrc_module


def num_epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Return the epochs whose tokens give at least ``num_samples`` samples of ``seq_length + 1`` tokens."""
    if tokens_per_epoch <= 0:
        raise ValueError("the split has no tokens: every document in it is empty")
    # ((epochs * tokens - 1) // seq_length) >= num_samples, solved directly instead of Megatron's loop.
    need = num_samples * seq_length + 1
    return max(1, -(-need // tokens_per_epoch))


def build_doc_idx(
    documents: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_last_epoch: bool
) -> np.ndarray:
    """Return int32 [num_epochs * len(documents)]: documents repeated per epoch, shuffled by ``rng``.

    With ``separate_last_epoch`` the last epoch is shuffled on its own, so a small last partial epoch
    does not mix with (and oversample documents of) the full ones.
    """
    if not separate_last_epoch or num_epochs == 1:
        doc_idx = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
        rng.shuffle(doc_idx)
        return doc_idx
    first = build_doc_idx(documents, num_epochs - 1, rng, False)
    last = build_doc_idx(documents, 1, rng, False)
    return np.concatenate((first, last))


def _sample_idx_dtype(doc_idx_len: int) -> type:
    return np.int32 if doc_idx_len < np.iinfo(np.int32).max else np.int64


def build_sample_idx_numpy(
    sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, num_epochs: int, tokens_per_epoch: int
) -> np.ndarray:
    """Return [num_samples + 1, 2] (doc_idx position, offset) of the token where each sample starts.

    Megatron walks documents sample by sample; equivalently, sample i starts at global token
    ``i * seq_length`` of the concatenated ``doc_idx`` stream, so one ``searchsorted`` finds them all.
    ``sizes`` int32 [num_docs_total], ``doc_idx`` int32 [epochs * docs].
    """
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    stream_sizes = np.asarray(sizes)[doc_idx].astype(np.int64)
    ends = np.cumsum(stream_sizes)
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    # The document holding token g is the first whose end exceeds g (empty documents are skipped).
    position = np.searchsorted(ends, starts, side="right")
    offset = starts - (ends[position] - stream_sizes[position])
    out = np.empty((num_samples + 1, 2), dtype=_sample_idx_dtype(len(doc_idx)))
    out[:, 0] = position
    out[:, 1] = offset
    out[0] = (0, 0)  # Megatron starts at (0, 0) even when the first document is empty
    return out


def build_sample_idx(
    sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, num_epochs: int, tokens_per_epoch: int
) -> np.ndarray:
    """Return the sample index ([num_samples + 1, 2]); C++ helper when built, else numpy."""
    helpers = csrc_helpers()
    if helpers is None:
        return build_sample_idx_numpy(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch)
    sizes = np.ascontiguousarray(sizes, dtype=np.int32)
    doc_idx = np.ascontiguousarray(doc_idx, dtype=np.int32)
    if _sample_idx_dtype(len(doc_idx)) == np.int32:
        return helpers.build_sample_idx_int32(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch)
    return helpers.build_sample_idx_int64(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch)


def build_shuffle_idx(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """Return [total_size]: a shuffle of ``[0, num_samples)`` followed by one of ``[num_samples, total)``."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_blending_indices_numpy(weights: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Return (dataset_index int16 [size], dataset_sample_index int64 [size]) by the greedy rule.

    Sample i goes to ``argmax_d(w_d * max(i, 1) - count_d)`` (first on ties), so every prefix of the
    interleave stays as close as possible to the weights.
    """
    weights = [float(w) for w in weights]
    counts = [0] * len(weights)
    dataset_index = np.empty(size, dtype=np.int16)
    dataset_sample_index = np.empty(size, dtype=np.int64)
    order = range(len(weights))
    for i in range(size):
        scale = max(float(i), 1.0)
        best = max(order, key=lambda d: (weights[d] * scale - counts[d], -d))
        dataset_index[i] = best
        dataset_sample_index[i] = counts[best]
        counts[best] += 1
    return dataset_index, dataset_sample_index


def build_blending_indices(weights: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Return the blending indices (see ``build_blending_indices_numpy``); C++ helper when built."""
    weights = np.ascontiguousarray(weights, dtype=np.float64)
    if len(weights) >= np.iinfo(np.int16).max:
        raise ValueError(f"{len(weights)} blended datasets; at most {np.iinfo(np.int16).max - 1}")
    helpers = csrc_helpers()
    if helpers is None:
        return build_blending_indices_numpy(weights, size)
    dataset_index = np.empty(size, dtype=np.int16)
    dataset_sample_index = np.empty(size, dtype=np.int64)
    helpers.build_blending_indices(dataset_index, dataset_sample_index, weights, int(size))
    return dataset_index, dataset_sample_index
