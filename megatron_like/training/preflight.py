"""Paths checked up front, before any process group starts (a ConfigError of one line each):

* ``--save``, ``--tensorboard-dir`` and (when data is read) ``--data-cache-path`` are created if needed and must
  accept a file (a probe file is written and removed);
* ``--load`` must be a directory holding ``latest_checkpointed_iteration.txt`` naming an existing ``iter_``
  directory, unless ``--load`` equals ``--save``: that is the auto-resume pattern of the launch
  scripts, where the first launch finds nothing and starts from scratch (the training loop prints a
  one-line notice);
* the tokenizer files given (``--vocab-file``, ``--merge-file``, ``--tokenizer-model``) must exist;
* every ``--data-path`` prefix (also in a blended ``weight prefix weight prefix`` list) must have both
  its ``.bin`` and its ``.idx`` file, an index that opens (``IndexedDataset``'s checks: header, sizes,
  pointers, document index, ``.bin`` length) and token ids inside the tokenizer's vocabulary (the
  range is scanned once per dataset and cached, ``megatron_like/data/token_range.py``); GPT data only:
  ``check_gpt_data``.
"""

from __future__ import annotations

import os
import tempfile

from megatron_like.config import CheckpointConfig, Config, ConfigError, DataConfig

TRACKER_FILE = "latest_checkpointed_iteration.txt"


def _same_directory(a: str, b: str | None) -> bool:
    return b is not None and os.path.realpath(a) == os.path.realpath(b)


def check_writable_dir(flag: str, path: str) -> None:
    """The directory ``path`` of ``flag`` exists (created here) and is writable by this process."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"{flag} {path} cannot be created: {error.strerror or error}; pick a writable "
                          "directory") from None
    try:
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write_probe."):
            pass
    except OSError as error:
        raise ConfigError(f"{flag} {path} is not writable: {error.strerror or error}; pick a writable "
                          "directory") from None


def check_save_dir(save: str) -> None:
    """``--save`` exists (created here) and is writable by this process."""
    check_writable_dir("--save", save)


def check_load_dir(load: str, save: str | None) -> None:
    """``--load`` names a checkpoint (or equals ``--save``, which may not hold one yet)."""
    resume_pattern = _same_directory(load, save)
    tracker = os.path.join(load, TRACKER_FILE)
    if os.path.isfile(load):
        raise ConfigError(f"--load {load} is a file; pass the checkpoint directory (the one holding {TRACKER_FILE} "
                          "and the iter_ directories)")
    if not os.path.exists(tracker):
        if resume_pattern:
            return
        if not os.path.isdir(load):
            raise ConfigError(f"--load {load} does not exist; pass a checkpoint directory (or the same "
                              "directory as --save to resume a run that may not have saved yet)")
        raise ConfigError(f"--load {load} holds no {TRACKER_FILE}: it is not a checkpoint directory (a "
                          "checkpoint is <dir>/iter_XXXXXXX plus that file)")
    from megatron_like.training.checkpointing import CheckpointError, read_tracker  # imports torch

    try:
        iteration = read_tracker(tracker)
    except CheckpointError as error:
        raise ConfigError(str(error)) from None
    iteration_dir = os.path.join(load, f"iter_{iteration:07d}")
    if not os.path.isdir(iteration_dir):
        raise ConfigError(f"{tracker} names iteration {iteration} but {iteration_dir} does not exist; write "
                          "the number of an existing iter_ directory into it")


def check_checkpoint_paths(checkpoint: CheckpointConfig) -> None:
    """The ``--save`` and ``--load`` rules of the module docstring."""
    if checkpoint.save:
        check_save_dir(checkpoint.save)
    if checkpoint.load:
        check_load_dir(checkpoint.load, checkpoint.save)


def check_tokenizer_files(vocab_file: str | None, merge_file: str | None, tokenizer_model: str | None) -> None:
    """Every tokenizer file given on the command line exists (``--tokenizer-model`` may be a directory)."""
    for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
        if path is not None and not os.path.isfile(path):
            raise ConfigError(f"{flag} {path} is not a file; pass the GPT-2 BPE file (encoder.json / vocab.bpe), "
                              "or neither --vocab-file nor --merge-file for the original GPT-2 files")
    if tokenizer_model is not None and not os.path.exists(tokenizer_model):
        raise ConfigError(f"--tokenizer-model {tokenizer_model} does not exist; pass a tokenizer.json or the "
                          "directory holding it")


def check_run_paths(config: Config) -> None:
    """Every path rule of the module docstring but the data prefixes (which only GPT data has)."""
    check_checkpoint_paths(config.checkpoint)
    if config.logging.tensorboard_dir:
        check_writable_dir("--tensorboard-dir", config.logging.tensorboard_dir)
    d = config.data
    if d.data_cache_path and not d.mock_data:
        check_writable_dir("--data-cache-path", d.data_cache_path)
    check_tokenizer_files(d.vocab_file, d.merge_file, d.tokenizer_model)


def check_data_prefixes(data_path: list[str]) -> list[str]:
    """Return the prefixes of ``--data-path`` (plain or blended), each checked to have its ``.bin`` and ``.idx``."""
    from megatron_like.data.blended_dataset import parse_data_path

    try:
        prefixes, _ = parse_data_path(data_path)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    for prefix in prefixes:
        missing = [prefix + ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
        if missing:
            raise ConfigError(f"--data-path prefix {prefix}: {' and '.join(missing)} not found; pass the prefix "
                              "data_tools/preprocess.py wrote (the path without .bin/.idx)")
    return prefixes


def _vocabulary_fix(data: DataConfig, vocab_size: int, largest: int) -> str:
    """What to do about a token id outside the vocabulary: depends on where the vocabulary comes from."""
    if data.tokenizer_type == "NullTokenizer":  # ids 0 .. --vocab-size, the last one end-of-document
        return (f"the NullTokenizer's ids are 0..--vocab-size {vocab_size - 1}: pass --vocab-size {largest} "
                "or more")
    tokenizer = data.tokenizer_type or "GPT2BPETokenizer"
    return (f"the corpus was binarized with another tokenizer than --tokenizer-type {tokenizer} ({vocab_size} ids): "
            "binarize it again with data_tools/preprocess.py, or train with the tokenizer it was made with")


def check_gpt_data(data: DataConfig, vocab_size: int) -> None:
    """``check_data_prefixes``, then each dataset's index opens and its token ids lie in [0, ``vocab_size``)."""
    from megatron_like.data.dataset_builder import default_cache_dir
    from megatron_like.data.indexed_dataset import IndexedDataset, IndexedDatasetError
    from megatron_like.data.token_range import cached_token_id_range

    for prefix in check_data_prefixes(data.data_path):
        try:
            indexed = IndexedDataset(prefix)
        except (IndexedDatasetError, OSError) as error:
            raise ConfigError(f"--data-path prefix {prefix}: {error}; binarize the corpus again with "
                              "data_tools/preprocess.py") from None
        smallest, largest = cached_token_id_range(indexed, default_cache_dir(prefix, data.data_cache_path))
        if smallest < 0:
            raise ConfigError(f"--data-path prefix {prefix}: {prefix}.bin holds token id {smallest}, and token "
                              "ids are never negative: binarize the corpus again with data_tools/preprocess.py")
        if largest >= vocab_size:
            raise ConfigError(f"--data-path prefix {prefix}: {prefix}.bin holds token id {largest}, outside the "
                              f"vocabulary; {_vocabulary_fix(data, vocab_size, largest)}")
