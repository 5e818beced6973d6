"""Retries: which errors are transient, the backoff, and real faults from an S3 server (errors
injected by a proxy in front of moto, cut connections, a server stopped and started again)."""

from __future__ import annotations

import asyncio
import errno
import threading
import time
from typing import Any

import aiohttp
import pytest
from botocore.exceptions import ClientError, EndpointConnectionError, ReadTimeoutError
from conftest import s3_options
from fsspec_helpers import FaultProxy, free_port
from moto.server import ThreadedMotoServer
from s3fs.errors import translate_boto_error

from planaria.errors import StorageError
from planaria_fsspec import FsspecStorage, FsspecStorageOptions
from planaria_fsspec.retry import Retrier, is_transient


def client_error(code: str, status: int, operation: str = "GetObject") -> ClientError:
    response: Any = {
        "Error": {"Code": code, "Message": f"{code} from the server"},
        "ResponseMetadata": {"HTTPStatusCode": status},
    }
    return ClientError(response, operation)


def chained(outer: BaseException, cause: BaseException) -> BaseException:
    outer.__cause__ = cause
    return outer


@pytest.mark.parametrize(
    ("exc", "transient"),
    [
        (client_error("SlowDown", 503), True),
        (client_error("InternalError", 500), True),
        (client_error("RequestTimeout", 400), True),
        (client_error("ThrottlingException", 400), True),
        (client_error("Whatever", 502), True),
        (client_error("TooManyRequests", 429), True),
        (client_error("AccessDenied", 403), False),
        (client_error("NoSuchKey", 404), False),
        (client_error("InvalidRange", 416), False),
        (translate_boto_error(client_error("SlowDown", 503)), True),
        (translate_boto_error(client_error("ServiceUnavailable", 503)), True),
        (translate_boto_error(client_error("AccessDenied", 403)), False),
        (translate_boto_error(client_error("NoSuchKey", 404)), False),
        (translate_boto_error(client_error("InvalidArgument", 400)), False),
        (EndpointConnectionError(endpoint_url="http://127.0.0.1:9"), True),
        (ReadTimeoutError(endpoint_url="http://127.0.0.1:9"), True),
        (aiohttp.ServerDisconnectedError(), True),
        (aiohttp.ClientPayloadError("truncated"), True),
        (ConnectionRefusedError(errno.ECONNREFUSED, "refused"), True),
        (TimeoutError("timed out"), True),
        (asyncio.TimeoutError(), True),
        (chained(RuntimeError("wrapped"), ConnectionResetError()), True),
        (FileNotFoundError("nope"), False),
        (PermissionError("no"), False),
        (chained(PermissionError("no"), ConnectionResetError()), False),
        (ValueError("bad"), False),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, BaseException) else str(value),
)
def test_is_transient(exc: BaseException, transient: bool) -> None:
    assert is_transient(exc) is transient


def test_aiohttp_response_errors_by_status() -> None:
    def response_error(status: int) -> aiohttp.ClientResponseError:
        return aiohttp.ClientResponseError(None, (), status=status)  # type: ignore[arg-type]

    assert is_transient(response_error(503))
    assert is_transient(response_error(429))
    assert not is_transient(response_error(400))
    assert not is_transient(response_error(404))


def test_backoff_is_exponential_jittered_and_capped() -> None:
    retrier = Retrier(retries=10, backoff=0.1, backoff_max=1.0)
    for attempt in range(10):
        ceiling = min(1.0, 0.1 * 2**attempt)
        delays = {retrier.delay(attempt) for _ in range(50)}
        assert all(ceiling / 2 <= d <= ceiling for d in delays)
        assert len(delays) > 1  # jittered


def test_retrier_retries_transient_errors_only() -> None:
    slept: list[float] = []
    retrier = Retrier(retries=3, backoff=0.01, backoff_max=0.05, sleep=slept.append)
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError("reset by peer")
        return "done"

    assert retrier.call("op", flaky) == "done"
    assert len(calls) == 3 and len(slept) == 2

    calls.clear()

    def always_down() -> None:
        calls.append(1)
        raise ConnectionRefusedError("refused")

    with pytest.raises(ConnectionRefusedError):
        retrier.call("op", always_down)
    assert len(calls) == 4  # the first try and 3 retries

    calls.clear()

    def denied() -> None:
        calls.append(1)
        raise PermissionError("denied")

    with pytest.raises(PermissionError):
        retrier.call("op", denied)
    assert len(calls) == 1


# -- against the S3 server ------------------------------------------------------------------------


def s3_storage(endpoint: str, bucket: str, **options: Any) -> FsspecStorage:
    """A storage whose only retries are its own: s3fs's and botocore's are turned off."""
    storage_options = s3_options(
        endpoint, config_kwargs={"retries": {"total_max_attempts": 1}, "connect_timeout": 5}
    )
    defaults: dict[str, Any] = {"retry_backoff": 0.01, "retry_backoff_max": 0.05}
    storage = FsspecStorage(
        FsspecStorageOptions(
            url=f"s3://{bucket}/run", storage_options=storage_options, **{**defaults, **options}
        )
    )
    storage.fs.retries = 1  # s3fs's own retry loop
    return storage


def test_throttling_is_retried_until_it_passes(proxy: FaultProxy, bucket: str) -> None:
    storage = s3_storage(proxy.endpoint, bucket)
    storage.write("step-1/a", [b"payload"])
    proxy.fail(2, 503, "SlowDown", method="GET")
    assert storage.read("step-1/a") == b"payload"
    assert proxy.outcomes().count("status 503") == 2
    proxy.fail(3, 500, "InternalError", method="PUT")
    storage.write("step-1/b", [b"more"])
    assert proxy.outcomes().count("status 500") == 3
    assert storage.read("step-1/b") == b"more"


def test_transient_errors_past_the_budget_name_the_url(proxy: FaultProxy, bucket: str) -> None:
    storage = s3_storage(proxy.endpoint, bucket, retries=2)
    storage.write("k", [b"v"])
    proxy.fail(10, 503, "SlowDown")
    with pytest.raises(StorageError) as caught:
        storage.read("k")
    message = str(caught.value)
    assert f"s3://{bucket}/run/k" in message
    assert "transient" in message and "gave up after 2 retries" in message
    assert proxy.outcomes().count("status 503") == 3


def test_cut_connections_are_retried(proxy: FaultProxy, bucket: str) -> None:
    storage = s3_storage(proxy.endpoint, bucket)
    proxy.reset(2, method="PUT")
    storage.write("a/b", [b"x" * 1000])
    proxy.reset(2)
    assert storage.list("a") == ["b"]
    assert proxy.outcomes().count("reset") == 4
    assert storage.read("a/b") == b"x" * 1000


def test_permission_errors_are_not_retried(proxy: FaultProxy, bucket: str) -> None:
    # A retry would wait 10 s first: far above what one call takes on a busy machine.
    storage = s3_storage(proxy.endpoint, bucket, retry_backoff=10.0, retry_backoff_max=10.0)
    proxy.fail(1, 403, "AccessDenied", method="PUT")
    started = time.monotonic()
    with pytest.raises(StorageError, match="permission denied") as caught:
        storage.write("step-1/a", [b"x"])
    assert time.monotonic() - started < 10.0
    puts = [seen.outcome for seen in proxy.seen if seen.method == "PUT" and "step-1/a" in seen.path]
    assert puts == ["status 403"]
    assert f"s3://{bucket}/run/step-1/a" in str(caught.value)
    # One fault was queued: a retry would have gone through and written the object.
    with pytest.raises(FileNotFoundError):
        storage.read("step-1/a")


def test_other_client_errors_are_not_retried(proxy: FaultProxy, bucket: str) -> None:
    storage = s3_storage(proxy.endpoint, bucket, retry_backoff=1.0, retry_backoff_max=1.0)
    storage.write("k", [b"v"])
    proxy.fail(1, 400, "InvalidArgument", method="GET")
    with pytest.raises(StorageError, match=r"InvalidArgument|injected") as caught:
        storage.read("k")
    assert "transient" not in str(caught.value)
    assert storage.read("k") == b"v"


def test_a_missing_key_is_file_not_found_at_once(proxy: FaultProxy, bucket: str) -> None:
    # A retry would wait 10 s first: far above what the two calls take on a busy machine.
    storage = s3_storage(proxy.endpoint, bucket, retry_backoff=10.0, retry_backoff_max=10.0)
    started = time.monotonic()
    with pytest.raises(FileNotFoundError):
        storage.read("no/such/key")
    with pytest.raises(FileNotFoundError):
        storage.size("no/such/key")
    assert time.monotonic() - started < 10.0
    assert "status" not in " ".join(proxy.outcomes())


def test_a_missing_bucket_is_a_storage_error(moto_endpoint: str) -> None:
    storage = s3_storage(moto_endpoint, "no-such-bucket-here")
    with pytest.raises(StorageError, match="s3://no-such-bucket-here/run/k"):
        storage.write("k", [b"v"])


def test_a_large_one_shot_write_is_not_replayed(proxy: FaultProxy, bucket: str) -> None:
    storage = s3_storage(proxy.endpoint, bucket)
    part = storage.options.part_size

    def chunks() -> Any:
        for _ in range(3):
            yield b"z" * part

    proxy.fail(1, 503, "SlowDown", method="PUT")
    with pytest.raises(StorageError, match="one-shot iterator"):
        storage.write("big", chunks())
    with pytest.raises(FileNotFoundError):
        storage.read("big")
    # The same data as a list of buffers can be sent again.
    proxy.fail(1, 503, "SlowDown", method="PUT")
    assert storage.write("big", list(chunks())) == 3 * part
    assert storage.size("big") == 3 * part


def test_a_server_stopped_and_started_again(bucket: str, moto_endpoint: str) -> None:
    """A second moto server (moto's state is per process, so it serves the same buckets) is
    stopped; the storage retries while it is down and succeeds once it is back."""
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    restarted: list[ThreadedMotoServer] = []
    try:
        endpoint = f"http://127.0.0.1:{port}"
        storage = s3_storage(endpoint, bucket, retries=12, retry_backoff=0.1, retry_backoff_max=0.5)
        storage.write("step-1/a", [b"before the outage"])
        server.stop()

        def start_again() -> None:
            time.sleep(1.5)
            again = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
            again.start()
            restarted.append(again)

        thread = threading.Thread(target=start_again)
        thread.start()
        started = time.monotonic()
        assert storage.read("step-1/a") == b"before the outage"
        assert time.monotonic() - started >= 1.0  # it did wait for the server
        thread.join()
        storage.write("step-1/b", [b"after"])
        assert storage.list("step-1") == ["a", "b"]
    finally:
        server.stop()
        for again in restarted:
            again.stop()
