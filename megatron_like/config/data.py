"""DataConfig: where training samples come from and how text becomes tokens, and their rules."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from megatron_like.config.errors import ConfigError, _require
from megatron_like.config.fields import NON_NEGATIVE


@dataclass
class DataConfig:
    """Where training samples come from and how text becomes tokens."""

    data_path: list[str] = field(default_factory=list)
    """Dataset prefixes, optionally weighted: 'pathA' or '0.3 pathA 0.7 pathB'."""
    split: str = "969,30,1"
    """Train/validation/test proportions of the documents."""
    mock_data: bool = False
    """Train on deterministic synthetic tokens (needs --vocab-size); no files are read."""
    tokenizer_type: Literal["GPT2BPETokenizer", "HuggingFaceTokenizer", "NullTokenizer"] | None = None
    """Tokenizer; defaults to NullTokenizer with --mock-data, else GPT2BPETokenizer."""
    vocab_file: str | None = None
    """GPT-2 vocabulary (encoder.json); defaults to the original GPT-2 file."""
    merge_file: str | None = None
    """GPT-2 merges (vocab.bpe); defaults to the original GPT-2 file."""
    tokenizer_model: str | None = None
    """tokenizer.json for the HuggingFaceTokenizer."""
    data_cache_path: str | None = None
    """Directory for the cached sample indices; defaults to beside the data."""
    num_workers: Annotated[int, NON_NEGATIVE] = 2
    """Data loader worker processes."""
    eod_mask_loss: bool = False
    """Do not train on the prediction made at an end-of-document token (the next document's first token)."""
    reset_position_ids: bool = False
    """Restart the position ids at 0 after each end-of-document token (packed documents; learned absolute
    positions see it, RoPE is relative and attention within a document is the same either way)."""
    reset_attention_mask: bool = False
    """Attention stops at each end-of-document token: a token sees only its own document of a packed sample
    (document ids reach attention, which skips the other documents' key blocks; no [s, s] mask)."""

    def validate(self) -> None:
        _require(
            self.mock_data or self.data_path,
            "no training data: pass --data-path PREFIX (see data_tools/preprocess.py) or --mock-data",
        )
        parts = self.split.replace("/", ",").split(",")
        try:
            weights = [float(p) for p in parts]
        except ValueError:
            raise ConfigError(f"--split {self.split!r} must be comma-separated numbers like 969,30,1") from None
        _require(
            len(weights) <= 3 and all(w >= 0 for w in weights) and sum(weights) > 0,
            f"--split {self.split!r} needs up to three non-negative numbers with a positive sum",
        )
        for flag, on in (("--reset-position-ids", self.reset_position_ids),
                         ("--reset-attention-mask", self.reset_attention_mask)):
            _require(not (on and self.mock_data),
                     f"{flag} needs end-of-document tokens and --mock-data has none: pass --data-path")
