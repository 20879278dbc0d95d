"""An HTTP/1.1 request handler whose every answer has a status line and a JSON body, malformed requests included.

``http.server.BaseHTTPRequestHandler`` leaves some malformed requests without a proper answer; this
handler (the base of ``tools/text_generation_server.py``'s) closes each gap:

* a request line it cannot parse is answered as HTTP/1.x: the base class takes such a client for
  HTTP/0.9 and writes the body with no status line and no headers;
* a head whose lines end with a bare CR (no LF) is refused at once (``400``) when the CR arrives with
  the bytes before it (a client sends its head in one piece); the base class waits for an LF that
  never comes, then closes without a word (here: ``408``, below, if the CR came in a later piece);
* a request that stops arriving (request line, headers or body) gets ``408`` after ``timeout`` seconds,
  where the base class closes silently; an idle connection between requests is closed silently;
* a request line of blanks gets ``400`` (the base class closes silently), while empty lines before a
  request line are skipped (RFC 9112 §2.2);
* an unknown method gets ``405`` like the known ones the subclass refuses (the base class: ``501``);
* after an early refusal the connection is closed gracefully: the answer is sent, the client's unread
  bytes are drained for up to ``LINGER_SECONDS`` before the close, as a reset on close could destroy
  the answer before the client reads it.

``content_length()`` accepts one Content-Length of plain digits only and no Transfer-Encoding.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import time
from http.server import BaseHTTPRequestHandler

MAX_LINE_BYTES = 65536
"""Longest request line (and header line): the base class's limits."""
MAX_EMPTY_LINES = 16
"""Empty lines skipped before a request line (RFC 9112 asks for at least one)."""
LINGER_SECONDS = 2.0
"""How long a refused request's unread bytes are drained before the connection closes."""
LINGER_BYTES = 1 << 24
"""At most this many unread bytes are drained."""

_BARE_CR = re.compile(rb"\r[^\n]")
_DIGITS = re.compile(r"[0-9]{1,18}")


def bare_cr_in_head(buffered: bytes) -> bool:
    """Return whether the request head at the start of ``buffered`` ends a line with a CR not followed by LF.

    Only the head (up to its first empty line) is read; a CR that is the last byte seen is undecided
    (its LF may be on the way).
    """
    ends = [i for i in (buffered.find(b"\r\n\r\n"), buffered.find(b"\n\n")) if i >= 0]
    head = buffered[: min(ends) + 1] if ends else buffered
    return _BARE_CR.search(head) is not None


class LengthError(ValueError):
    """A request whose body length cannot be known: ``status`` (400 or 411) and the message to send."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class JsonRequestHandler(BaseHTTPRequestHandler):
    """Answers every request with a status line and a JSON body; subclasses define ``do_<METHOD>``."""

    protocol_version = "HTTP/1.1"
    default_request_version = "HTTP/1.0"  # what a request line without a valid version is answered as
    timeout: float = 60.0
    """Seconds a client may take to send any part of its request (the socket timeout)."""
    drain_before_close = False
    """Set by a refusal: the client may still be sending, so ``finish`` drains before the close."""

    def reply(self, status: int, body: dict) -> None:
        """Send ``body`` as JSON with ``status``; says ``Connection: close`` when the connection will close."""
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def error_body(self, message: str) -> dict:
        """The JSON body of a refusal (a subclass may answer some paths in another shape)."""
        return {"message": message}

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """Refuse the request with ``error_body`` and close the connection (drained first, see finish)."""
        self.close_connection = True
        self.drain_before_close = True
        with contextlib.suppress(OSError):  # the client may be gone
            self.reply(code, self.error_body(message or self.responses.get(code, ("error",))[0]))

    def refuse_method(self) -> None:
        """``405`` for any method the subclass does not serve."""
        self.send_error(405, f"{self.command} is not supported")

    def handle_one_request(self) -> None:
        """Read, parse and dispatch one request; answer it even when malformed or late (module docstring)."""
        self.request_started = False
        # What an answer before parse_request (which sets them) reads: a status line is always written.
        self.requestline, self.command, self.request_version = "", "", self.default_request_version
        try:
            self._handle_one_request()
        except TimeoutError:
            if self.request_started:
                self.send_error(408, f"the request did not arrive within {self.timeout:g} s")
            self.close_connection = True

    def _handle_one_request(self) -> None:
        for _ in range(MAX_EMPTY_LINES + 1):
            buffered = self.rfile.peek(MAX_LINE_BYTES)  # waits for the first bytes; b"" when the client is gone
            if not buffered:
                self.close_connection = True
                return
            self.request_started = True
            if bare_cr_in_head(buffered):
                return self.send_error(400, "a line of the request ends with a bare CR: end lines with CRLF")
            self.raw_requestline = self.rfile.readline(MAX_LINE_BYTES + 1)
            if self.raw_requestline not in (b"\r\n", b"\n"):
                break
        if len(self.raw_requestline) > MAX_LINE_BYTES:
            return self.send_error(414, f"the request line is longer than {MAX_LINE_BYTES} bytes")
        if not self.raw_requestline.strip():
            return self.send_error(400, "the request line is blank")
        if not self.parse_request():  # it answered through send_error
            return
        getattr(self, f"do_{self.command}", self.refuse_method)()
        self.wfile.flush()

    def content_length(self, limit: int) -> int:
        """Return the request's Content-Length, at most ``limit``; LengthError says why it is unusable."""
        if "Transfer-Encoding" in self.headers:
            raise LengthError(411, "Transfer-Encoding is not supported: send the body with a Content-Length")
        values = self.headers.get_all("Content-Length") or []
        if not values:
            raise LengthError(411, "Content-Length is required")
        if len(set(values)) > 1 or not _DIGITS.fullmatch(values[0].strip()):
            raise LengthError(400, f"Content-Length must be one number of bytes, got {', '.join(values)[:80]!r}")
        length = int(values[0])
        if length > limit:
            raise LengthError(400, f"request body of {length} bytes exceeds the limit of {limit} bytes")
        return length

    def read_body(self, length: int) -> bytes:
        """Return the ``length`` bytes of the body; LengthError when the client ends it early."""
        body = self.rfile.read(length)
        if len(body) < length:
            raise LengthError(400, f"the body ended after {len(body)} of its Content-Length {length} bytes")
        return body

    def finish(self) -> None:
        """Send what is buffered; after a refusal, drain the client's unread bytes before the close."""
        super().finish()
        if not self.drain_before_close:
            return
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_WR)  # the answer is complete: the client sees its end
            deadline, drained = time.monotonic() + LINGER_SECONDS, 0
            while drained < LINGER_BYTES and (left := deadline - time.monotonic()) > 0:
                self.connection.settimeout(left)
                chunk = self.connection.recv(1 << 16)
                if not chunk:
                    break
                drained += len(chunk)
