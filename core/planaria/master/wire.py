"""HTTP/1.1 at the byte level, for the API's hot routes (:mod:`planaria.master.server`).

A master of 10,000 nodes answers 10,000 heartbeats a second. The HTTP server's general request
machinery (its request and response objects, routing, middlewares, a task per request) costs
more than the heartbeat itself, so a heartbeat that arrives whole, in the plain form agents
send, is read and answered here instead. Everything else (another route, a header this reader
does not take, a body split across reads, a request that is wrong in any way) goes to the
server exactly as it came, which answers it as always.

The reader is strict on purpose: what it takes is a subset of what the server takes, never
more, and it reads it the same way.
"""

from __future__ import annotations

import email.utils
import re
import time
from dataclasses import dataclass

from aiohttp.http import SERVER_SOFTWARE

_TOKEN = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_VALUE = rb"[^\x00-\x08\x0a-\x1f\x7f]*"
_FIELD = re.compile(rb"(" + _TOKEN + rb"):[ \t]*(" + _VALUE + rb")\r\n")
_HEAD = re.compile(
    rb"(" + _TOKEN + rb") (/[!-~]*) HTTP/1\.([01])\r\n((?:" + _TOKEN + rb":" + _VALUE + rb"\r\n)*)"
)
"""A request head as the reader takes it, up to (not with) the empty line that ends it: the
request line, then header fields with no obsolete line folding and no control bytes."""

_PASS = frozenset({b"transfer-encoding", b"content-encoding", b"expect", b"upgrade"})
"""Fields that change how a request is read or answered: a request with any of them is the
server's to serve."""

MAX_HEAD = 65536
"""A head longer than this is not followed (the server refuses far shorter ones)."""


@dataclass(frozen=True)
class Head:
    method: bytes
    target: bytes
    minor: int
    """1 for HTTP/1.1, 0 for HTTP/1.0."""
    fields: dict[bytes, bytes]
    """Header fields by lower-case name, each value stripped of the white space around it (a
    name that came more than once: its last value, and :attr:`repeated` is set)."""
    repeated: bool
    """A field name came more than once."""

    def content_length(self) -> int | None:
        """The body's length (0 without the field); None if the field is not plain digits."""
        value = self.fields.get(b"content-length", b"0")
        return int(value) if value.isdigit() and len(value) < 19 else None


def read_head(block: bytes) -> Head | None:
    """A request head (the bytes before its ``\\r\\n\\r\\n``, that end with ``\\r\\n`` of the
    last line added back); None if it is not in the strict form this reader takes."""
    match = _HEAD.fullmatch(block)
    if match is None:
        return None
    fields: dict[bytes, bytes] = {}
    repeated = False
    for name, value in _FIELD.findall(match.group(4)):
        key = name.lower()
        if key in fields:
            repeated = True
        fields[key] = value.rstrip(b" \t")
    return Head(match.group(1), match.group(2), int(match.group(3)), fields, repeated)


def whole_request(data: bytes) -> tuple[Head, bytes] | None:
    """``data`` as exactly one whole request in the strict form, its head and its body; None
    when it is anything else (a partial request, two of them, a chunked body, an odd field)."""
    end = data.find(b"\r\n\r\n", 0, MAX_HEAD)
    if end < 0:
        return None
    head = read_head(data[: end + 2])
    if head is None or head.repeated or not _PASS.isdisjoint(head.fields):
        return None
    length = head.content_length()
    if length is None or len(data) != end + 4 + length:
        return None
    return head, data[end + 4 :]


class Framer:
    """Follows the requests on a connection that go to the server, to know when the server's
    own parser is between two requests (so that the next one can be read here instead). It
    loses track (for good: the server keeps the connection from then on) at anything it cannot
    follow for certain: a chunked body, an upgrade, a head that is not in the strict form."""

    __slots__ = ("_body_left", "_head", "lost")

    def __init__(self) -> None:
        self._head = b""
        self._body_left = 0
        self.lost = False

    @property
    def between(self) -> bool:
        """The bytes so far end with a whole request (or there were none)."""
        return not self.lost and not self._head and not self._body_left

    def feed(self, data: bytes) -> None:
        while data and not self.lost:
            if self._body_left:
                if len(data) <= self._body_left:
                    self._body_left -= len(data)
                    return
                data = data[self._body_left :]
                self._body_left = 0
                continue
            buffered = self._head + data
            end = buffered.find(b"\r\n\r\n")
            if end < 0:
                self._head = buffered
                self.lost = len(buffered) > MAX_HEAD
                return
            self._head = b""
            head = read_head(buffered[: end + 2])
            length = None if head is None else head.content_length()
            if (
                head is None
                or length is None
                or head.repeated
                or b"transfer-encoding" in head.fields
                or b"upgrade" in head.fields
                or head.method == b"CONNECT"
            ):
                self.lost = True
                return
            self._body_left = length
            data = buffered[end + 4 :]


class _Date:
    """The Date field, formatted once a second."""

    def __init__(self) -> None:
        self.second = -1
        self.value = b""

    def __call__(self) -> bytes:
        now = int(time.time())
        if now != self.second:
            self.second = now
            self.value = email.utils.formatdate(now, usegmt=True).encode()
        return self.value


_date = _Date()
_SERVER = SERVER_SOFTWARE.encode()
JSON_TYPE = b"application/json; charset=utf-8"
_REPLY = (
    b"HTTP/1.1 %d %s\r\n%sContent-Type: %s\r\nContent-Length: %d\r\nDate: %s\r\nServer: %s\r\n\r\n"
)


def reply(
    status: int,
    body: bytes,
    *,
    reason: bytes = b"OK",
    content_type: bytes = JSON_TYPE,
    fields: bytes = b"",
) -> bytes:
    """A whole HTTP/1.1 response with the fields the server puts in its own (``fields``: more
    of them, each line with its ``\\r\\n``, before those)."""
    head = _REPLY % (status, reason, fields, content_type, len(body), _date(), _SERVER)
    return head + body
