"""The emulated API server's errors: each one answered as the real server answers it, a
``Status`` object with its code, reason and details."""

from __future__ import annotations

from planaria_kubernetes.testing.semantics import Obj


class ApiError(Exception):
    """An error the API answers with a ``Status`` object."""

    def __init__(self, code: int, reason: str, message: str, details: Obj | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details

    def status(self) -> Obj:
        body: Obj = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details is not None:
            body["details"] = self.details
        return body


def not_found(plural: str, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{plural} "{name}" not found', {"name": name, "kind": plural})


def invalid(kind: str, name: str, field_path: str, reason: str, message: str) -> ApiError:
    return ApiError(
        422,
        "Invalid",
        f'{kind} "{name}" is invalid: {field_path}: {message}',
        {
            "name": name,
            "kind": kind,
            "causes": [{"reason": reason, "message": message, "field": field_path}],
        },
    )


def expired(rv: int, current: int) -> ApiError:
    return ApiError(410, "Expired", f"too old resource version: {rv} ({current})")
