"""The text of a growing list of generated tokens, decoding only a few tokens per new one (the server's answers).

Decoding the whole answer again after every token costs its length per token (quadratic in the answer). Here a
token's text is decoded in a short window that starts a few tokens earlier (Hugging Face text-generation-inference
and vLLM do the same): ``decode(window) - decode(window's old tokens)`` is the new text. The window's old tokens
give the decoder its left context, so a tokenizer whose text for a token depends on its neighbour (a
space-separated id list, SentencePiece's leading space) gets the same text as one decode of everything.

A byte-level tokenizer can end a token in the middle of a UTF-8 character: the decoder then shows ``"\\ufffd"``.
Such a tail is *pending*: it stays in the window (the next token may complete the character) and is not
confirmed; it is still part of :attr:`IncrementalText.text`, as it is of a full decode. ``text`` so always equals
``detokenize(tokens)`` (``tests/unit/test_incremental_detokenize.py`` checks it token by token on GPT-2's BPE with
split multi-byte characters), and only the pending tail can still change.

Bytes that never form a character (a model emitting garbage) would keep the tail pending for ever, and the window
would grow with the answer. A UTF-8 character is at most 4 bytes and a byte-level token at least one, so once
``MAX_PENDING`` tokens follow a point, every character that starts before it is decided (whole, or invalid for
good). With more pending tokens than that, the text of the window without its last ``MAX_PENDING`` tokens is
confirmed when the whole window's text starts with it, and the window moves on.
"""

from __future__ import annotations

from collections.abc import Callable

MAX_PENDING = 4
"""Tokens after which a character that started earlier is decided: UTF-8's longest character, one byte a token."""


class IncrementalText:
    """``detokenize(tokens)`` of tokens pushed one at a time, each decoded in a short window.

    Args:
        detokenize: ids -> text (the tokenizer's).
    """

    def __init__(self, detokenize: Callable[[list[int]], str]) -> None:
        self.detokenize = detokenize
        self.tokens: list[int] = []
        self.confirmed = ""
        """The text of ``tokens[:read]``: final (ends on a whole character)."""
        self.text = ""
        """The text of every pushed token: ``confirmed`` and the pending tail (which may end in ``"\\ufffd"``)."""
        self._context = 0  # the window starts here: tokens[_context:read] are decoded again as left context
        self._read = 0
        self._context_text = ""  # detokenize(tokens[_context:_read])

    def push(self, token: int) -> str:
        """Add ``token``; returns the new :attr:`text`."""
        self.tokens.append(token)
        window = self.detokenize(self.tokens[self._context:])
        if not window.startswith(self._context_text):  # the new token rewrote its context's text: decode it all
            self.text = self.detokenize(self.tokens)
            return self.text
        new = window[len(self._context_text):]
        self.text = self.confirmed + new
        if new and not new.endswith("\ufffd"):  # whole characters: confirm them, the window moves on
            self.confirmed = self.text
            self._move_window(len(self.tokens))
        elif len(self.tokens) - self._read > MAX_PENDING:  # bytes that stay invalid: confirm what is decided
            decided = len(self.tokens) - MAX_PENDING
            head = self.detokenize(self.tokens[self._context:decided])
            if head.startswith(self._context_text) and window.startswith(head):
                self.confirmed += head[len(self._context_text):]
                self._move_window(decided)
        return self.text

    def _move_window(self, read: int) -> None:
        """Tokens before ``read`` are confirmed; the last confirmed chunk becomes the window's left context."""
        self._context, self._read = self._read, read
        self._context_text = self.detokenize(self.tokens[self._context:self._read])


def first_stop(text: str, stops: list[str], start: int) -> int | None:
    """Index in ``text`` of the earliest match of any of ``stops``, or None, given that ``text[:start]`` holds none.

    ``start``: the length of the text already searched and final (a stop found in it would have ended the answer),
    so a match must reach past it: each stop is searched from ``len(stop) - 1`` characters before it."""
    found = [i for i in (text.find(s, max(0, start - len(s) + 1)) for s in stops) if i >= 0]
    return min(found) if found else None
