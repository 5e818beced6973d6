"""Which errors are worth retrying, and retrying them with capped exponential backoff.

fsspec's file systems surface the client library's exceptions as they are, or translated into
``OSError`` subclasses with the original as ``__cause__`` (s3fs). Both are inspected: a
connection failure, a timeout, an HTTP 5xx or 429 and the stores' throttling codes are
transient; a missing key, a refused permission and every other client error are not.
"""

from __future__ import annotations

import asyncio
import errno
import random
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from planaria.log import get_logger

T = TypeVar("T")

log = get_logger("storage.fsspec")

# Error codes the object stores use for "slow down" or "try again".
TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestLimitExceeded",
        "TooManyRequests",
        "TooManyRequestsException",
        "ProvisionedThroughputExceededException",
        "RequestTimeout",
        "RequestTimeTooSkewed",
        "InternalError",
        "InternalFailure",
        "ServiceUnavailable",
        "ServerBusy",
        "OperationTimedOut",
        "BandwidthLimitExceeded",
    }
)
TRANSIENT_ERRNOS = frozenset(
    {
        errno.EAGAIN,
        errno.EBUSY,
        errno.ETIMEDOUT,
        errno.ECONNRESET,
        errno.ECONNREFUSED,
        errno.ECONNABORTED,
        errno.EPIPE,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
        errno.ENETDOWN,
        getattr(errno, "EREMOTEIO", errno.EIO),
    }
)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, then its causes and contexts, each once."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        if current.__cause__ is not None:
            current = current.__cause__
        else:
            current = None if current.__suppress_context__ else current.__context__


def _http_status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):  # botocore's ClientError
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if isinstance(status, int):
            return status
    for attr in ("status", "status_code", "code"):  # aiohttp, azure, gcsfs
        value = getattr(exc, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and 100 <= value <= 599:
            return value
    return None


def _error_code(exc: BaseException) -> str | None:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        code = response.get("Error", {}).get("Code")
        if isinstance(code, str):
            return code
    code = getattr(exc, "error_code", None)  # azure
    return code if isinstance(code, str) else None


def _module(exc: BaseException) -> str:
    return type(exc).__module__.split(".", 1)[0]


def _transient_one(exc: BaseException) -> bool | None:
    """True or False when ``exc`` settles it, None when its cause should decide."""
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError)):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError, asyncio.TimeoutError)):
        return True
    code, status = _error_code(exc), _http_status(exc)
    if code is not None or status is not None:
        return (code in TRANSIENT_CODES) or (
            status is not None and (status >= 500 or status == 429)
        )
    name = type(exc).__name__
    if _module(exc) in ("botocore", "aiobotocore", "urllib3", "aiohttp", "requests"):
        # Connection and timeout errors of the HTTP stacks (EndpointConnectionError,
        # ConnectionClosedError, ReadTimeoutError, ServerDisconnectedError, ClientPayloadError ...)
        markers = ("Connection", "Timeout", "Disconnected", "Payload", "IncompleteRead")
        if any(marker in name for marker in markers) or name == "HTTPClientError":
            return True
    if name == "FSTimeoutError":
        return True
    if isinstance(exc, OSError) and exc.errno in TRANSIENT_ERRNOS:
        return True
    return None


def is_transient(exc: BaseException) -> bool:
    """Whether retrying the operation that raised ``exc`` may succeed."""
    for link in _chain(exc):
        verdict = _transient_one(link)
        if verdict is not None:
            return verdict
    return False


class Retrier:
    """Runs an operation, retrying transient errors ``retries`` times with jittered backoff."""

    def __init__(
        self,
        retries: int,
        backoff: float,
        backoff_max: float,
        *,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.retries = retries
        self.backoff = backoff
        self.backoff_max = backoff_max
        self._sleep = sleep

    def delay(self, attempt: int) -> float:
        """The pause before retry number ``attempt`` (0-based): full jitter under a capped
        exponential, never below half of it, so that many writers do not retry in step."""
        ceiling = min(self.backoff_max, self.backoff * (2.0**attempt))
        return random.uniform(ceiling / 2, ceiling)

    def call(self, what: str, operation: Callable[[], T], *, retries: int | None = None) -> T:
        """``operation()``; ``what`` names it in the log (``"read s3://b/run/step-1/x"``)."""
        limit = self.retries if retries is None else retries
        attempt = 0
        while True:
            try:
                return operation()
            except Exception as exc:
                if attempt >= limit or not is_transient(exc):
                    raise
                pause = self.delay(attempt)
                attempt += 1
                log.warning(
                    "storage operation failed, retrying",
                    operation=what,
                    attempt=attempt,
                    of=limit,
                    delay=round(pause, 3),
                    error=f"{type(exc).__name__}: {exc}",
                )
                self._sleep(pause)
