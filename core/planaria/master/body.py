"""A request's body read and parsed strictly, as its schema says: refused (413) once it is
over ``max_request_bytes``, chunked or compressed alike, (408) when it comes too slowly, and
(400) naming what is wrong and where when it is not the model it must be. The parse is on the
path of every heartbeat, so the common body takes no walk over its values."""

from __future__ import annotations

import asyncio
import math
from typing import Any, TypeVar

import pydantic_core
from aiohttp import web
from pydantic import BaseModel, ValidationError

from planaria.master.guard import LIMITS
from planaria.master.responses import BadRequest, error, invalid

M = TypeVar("M", bound=BaseModel)


async def read_limited(request: web.Request, limit: int) -> bytes:
    """The whole body, refused (413) as soon as it is over ``limit`` bytes: at once when its
    Content-Length says so, else when that many bytes came (a chunked body announces no size).
    Counted after any Content-Encoding is undone, so a small compressed body cannot expand
    past the limit either."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise BadRequest(too_large(f"{declared} bytes", limit))
    if request.content.is_eof():  # all of it came with the header: nothing to wait for
        whole = request.content.read_nowait()
        if len(whole) > limit:
            raise BadRequest(too_large(f"{len(whole)} bytes", limit))
        return whole
    body = bytearray()
    while chunk := await request.content.readany():
        body.extend(chunk)
        if len(body) > limit:
            raise BadRequest(too_large(f"at least {len(body)} bytes", limit))
    return bytes(body)


def too_large(size: str, limit: int) -> web.Response:
    """413, and the connection closed after it: the rest of the body is never read, and
    would otherwise be taken for the next request."""
    response = error(
        413, f"request body of {size} is over the limit of {limit} (master.max_request_bytes)"
    )
    response.force_close()
    return response


async def read_body(request: web.Request, model: type[M]) -> M:
    limits = request.app[LIMITS]
    try:
        if request.content.is_eof():  # the usual small body, whole already: no timer, no task
            raw = await read_limited(request, limits.max_request_bytes)
        else:
            raw = await asyncio.wait_for(
                read_limited(request, limits.max_request_bytes), timeout=limits.request_timeout
            )
    except asyncio.TimeoutError:
        raise BadRequest(
            error(408, f"the request body did not arrive within {limits.request_timeout:g}s")
        ) from None
    return parse(raw, model)


def parse(raw: bytes, model: type[M]) -> M:
    """A body read strictly as ``model`` says; BadRequest (400) naming what is wrong."""
    try:
        data = pydantic_core.from_json(raw, allow_inf_nan=False)
    except ValueError as exc:
        raise BadRequest(invalid(f"invalid {model.__name__}", [f"<body>: {exc}"])) from None
    return validate(data, model, raw)


def validate(data: Any, model: type[M], raw: bytes | str) -> M:
    """``data``, a body as JSON parsed it out of ``raw`` (the body, or a message that holds
    it), read strictly as ``model`` says; BadRequest (400) naming what is wrong."""
    if not may_overflow(raw if isinstance(raw, bytes) else raw.encode()):
        # No number can have become infinite: as agents send it.
        try:
            return model.model_validate(data, strict=True)
        except ValidationError:
            pass  # perhaps 3.0 for 3: the numbers as JSON Schema reads them, below
    try:
        data = numbers(data)
    except ValueError as exc:
        raise BadRequest(invalid(f"invalid {model.__name__}", [f"<body>: {exc}"])) from None
    try:
        # Strict: a field is the JSON type its schema says (no "1" for 1, no false for 0.0),
        # as agents send it; what the document describes is what the server takes.
        return model.model_validate(data, strict=True)
    except ValidationError as exc:
        problems = [
            f"{'.'.join(map(str, e['loc'])) or '<body>'}: {e['msg']}"
            for e in exc.errors(include_url=False)
        ]
        raise BadRequest(invalid(f"invalid {model.__name__}", problems)) from None


_CLASSES = bytes(
    {**dict.fromkeys(b"0123456789", 48), 46: 46, 101: 101, 69: 101, 43: 43, 45: 43}.get(i, 32)
    for i in range(256)
)
"""Each byte's class: digit ``0``, point ``.``, exponent ``e``, sign ``+``, other ``" "``."""
_RUN = b"0" * 200


def may_overflow(raw: bytes) -> bool:
    """Whether a JSON number in ``raw`` may overflow a float: a three-digit exponent after a
    digit or a point, or 200 digits in a row (fewer, times an exponent under 100, stay below
    1e299). A body without one is validated as it parsed, with no walk over its values.

    The bytes are mapped to their class (digit, point, exponent, sign, other) and the shapes
    looked for as plain substrings: several times faster than a regular expression, which
    costs more than the parse itself on a heartbeat of 8 ranks."""
    shape = raw.translate(_CLASSES)
    # The usual body has no digit or point before an "e" (a node id "node-12" is " e+00"),
    # so two searches: a heartbeat pays about 1 us in all.
    if (b"0e" in shape or b".e" in shape) and (
        b"0e000" in shape or b".e000" in shape or b"0e+000" in shape or b".e+000" in shape
    ):
        return True
    return _RUN in shape


def numbers(value: Any) -> Any:
    """JSON numbers as JSON Schema reads them: ``3.0`` is the integer 3 (a client in a language
    with one number type cannot tell them apart), and a number too large for a float (``1e999``)
    is refused rather than taken as infinity."""
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("a number is out of range")
        return int(value) if value.is_integer() else value
    if isinstance(value, list):
        return [numbers(v) for v in value]
    if isinstance(value, dict):
        return {k: numbers(v) for k, v in value.items()}
    return value
