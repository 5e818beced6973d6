"""The OpenAPI 3.1 document of the master's API, written from the route table
(:data:`planaria.master.routes.ROUTES`) and the wire models' JSON Schemas.

``planaria api-schema`` prints it; ``docs/api/openapi.json`` is its committed copy, which a test
keeps current.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from planaria.master.routes import ROUTES, Route
from planaria.protocol import API_PREFIX, ApiError, InvalidRequest

REF = "#/components/schemas/{model}"
SECURITY = "jobToken"

# Every error reply, by status: its name under components/responses, its model, its meaning.
ERRORS: dict[int, tuple[str, type[ApiError], str]] = {
    400: (
        "InvalidRequest",
        InvalidRequest,
        "The body is not valid JSON of the request's model (each problem names its field), "
        "or the job cannot accept it.",
    ),
    401: ("Unauthorized", ApiError, "Missing or wrong token: nothing was done."),
    403: ("Forbidden", ApiError, "Refused for good: the job never launched this node, or it left."),
    404: ("UnknownNode", ApiError, "The node named in the body is unknown: register first."),
    409: (
        "Conflict",
        ApiError,
        "Valid, but not now: the job's state does not allow it, or a restarted master asks "
        "the node to re-attach first (/v1/reattach).",
    ),
    410: (
        "Fenced",
        ApiError,
        "The node was declared lost and is fenced out of the job: it must stop its workers.",
    ),
    408: ("RequestTimeout", ApiError, "The body did not arrive within master.request_timeout."),
    413: ("TooLarge", ApiError, "The body is over master.max_request_bytes."),
    503: ("NotYet", ApiError, "The master cannot answer yet (retry is true): ask again shortly."),
}


def route_errors(route: Route) -> list[int]:
    """The error statuses ``route`` may answer."""
    shared = [] if route.public else [401]
    if route.request is not None:
        shared += [400, 408, 413]
    return sorted({*shared, *route.errors})


def document(routes: Sequence[Route] = ROUTES) -> dict[str, Any]:
    """The whole document. Request models are described as they validate, replies as they
    serialize; all in one pass of pydantic, so that two models of one name get distinct
    component names instead of overwriting each other."""
    wanted: list[tuple[type[BaseModel], JsonSchemaMode]] = []
    for route in routes:
        if route.request is not None:
            wanted.append((route.request, "validation"))
        wanted.append((route.reply, "serialization"))
    wanted += [(model, "serialization") for _, model, _ in ERRORS.values()]
    wanted = list(dict.fromkeys(wanted))
    refs, defs = models_json_schema(wanted, ref_template=REF)
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        operation: dict[str, Any] = {"operationId": route.operation_id, "summary": route.summary}
        if route.request is not None:
            operation["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": refs[(route.request, "validation")]}},
            }
        responses: dict[str, Any] = {
            "200": {
                "description": route.reply.__name__,
                "content": {route.media_type: {"schema": refs[(route.reply, "serialization")]}},
            }
        }
        for status in route_errors(route):
            responses[str(status)] = {"$ref": f"#/components/responses/{ERRORS[status][0]}"}
        operation["responses"] = responses
        if route.public:
            operation["security"] = []
        elif route.public_with is not None:  # the token, or none when the option says so
            operation["security"] = [{SECURITY: []}, {}]
        method: Literal["get", "post"] = "get" if route.method == "GET" else "post"
        paths.setdefault(route.path, {})[method] = operation
    responses = {
        name: {
            "description": meaning,
            "content": {"application/json": {"schema": refs[(model, "serialization")]}},
        }
        for name, model, meaning in ERRORS.values()
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "planaria master API",
            "version": API_PREFIX.strip("/"),
            "description": (
                "What a job's agents and tools ask of its master: JSON bodies, JSON replies "
                "(the metrics: Prometheus' text format). "
                "Every route needs the job's token (Authorization: Bearer <token>) except "
                "the public probe /healthz, and /metrics with master.metrics_public: true. "
                "See docs/api.md."
            ),
        },
        "paths": paths,
        "components": {
            "schemas": defs.get("$defs", {}),
            "responses": responses,
            "securitySchemes": {
                SECURITY: {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "The job's token, given to the agents it launches.",
                }
            },
        },
        "security": [{SECURITY: []}],
    }


def dumps(routes: Sequence[Route] = ROUTES) -> str:
    """The document as the committed file holds it: indented, keys in their order, a newline."""
    return json.dumps(document(routes), indent=2) + "\n"
