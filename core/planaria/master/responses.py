"""The API's answers as aiohttp responses: a reply model as JSON, and the refusals (400,
404, 409, 410, 413 ...) with what is wrong, each the status its error type calls for. A request
and a channel message refuse through :func:`refusal`, so their answers are the same."""

from __future__ import annotations

from aiohttp import web
from pydantic import BaseModel

from planaria.log import get_logger
from planaria.master.routes import UnknownRoute
from planaria.master.state import (
    BadReport,
    Conflict,
    FencedRequest,
    NotAttached,
    RegistrationRefused,
    UnknownNode,
)
from planaria.protocol import ApiError, InvalidRequest

log = get_logger("master")


def json_response(
    model: BaseModel,
    status: int = 200,
    headers: dict[str, str] | None = None,
    *,
    exclude_defaults: bool = False,
) -> web.Response:
    return web.Response(
        text=model.model_dump_json(exclude_defaults=exclude_defaults),
        status=status,
        content_type="application/json",
        headers=headers,
    )


def error(
    status: int, message: str, *, retry: bool = False, headers: dict[str, str] | None = None
) -> web.Response:
    return json_response(
        ApiError(error=message, retry=retry), status, headers, exclude_defaults=True
    )


def invalid(message: str, problems: list[str]) -> web.Response:
    return json_response(InvalidRequest(error=message, problems=problems), 400)


class BadRequest(Exception):
    def __init__(self, response: web.Response) -> None:
        self.response = response


def refusal(exc: Exception, method: str, path: str) -> web.Response:
    """The answer to a request whose serving raised ``exc`` (called in its ``except``)."""
    if isinstance(exc, BadRequest):
        return exc.response
    if isinstance(exc, FencedRequest):
        return error(410, str(exc))
    if isinstance(exc, NotAttached):
        return error(409, f"node {exc.args[0]!r}: re-attach first (a new master)")
    if isinstance(exc, UnknownRoute):
        return error(404, str(exc))
    if isinstance(exc, UnknownNode):
        return error(404, f"unknown node {exc.args[0]!r}: register first")
    if isinstance(exc, BadReport):
        return invalid(str(exc), [])
    if isinstance(exc, Conflict):
        return error(409, str(exc))
    if isinstance(exc, RegistrationRefused):
        if exc.retry:
            return error(503, str(exc), retry=True)
        return error(403, str(exc))
    log.exception("API request failed", method=method, path=path)
    return error(500, f"the master failed to serve {path}: {exc!r}")


def refused(request: web.Request, exc: Exception) -> web.Response:
    """The answer to ``request`` whose handler raised ``exc`` (called in its ``except``):
    aiohttp's own refusals (404, 405 ...) as JSON too; a redirect is raised on."""
    if isinstance(exc, web.HTTPException):
        if exc.status < 400:
            raise exc
        allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return error(exc.status, f"{request.method} {request.path}: {exc.reason}", headers=allow)
    return refusal(exc, request.method, request.path)
