"""Fixtures: a moto S3 server on loopback (one per session), a fresh bucket per test, and
storages on memory://, file:// and s3:// built the way a config file builds them."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import boto3
import fsspec
import pytest
from fsspec_helpers import FaultProxy, free_port
from moto.server import ThreadedMotoServer

CREDENTIALS = {"key": "testing", "secret": "testing"}


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """A real S3-compatible HTTP server (moto) on 127.0.0.1, stopped after the session."""
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


def s3_options(endpoint: str, **extra: Any) -> dict[str, Any]:
    """s3fs options for the test server; ``extra`` adds to them (retries, config_kwargs ...)."""
    return {
        "endpoint_url": endpoint,
        **CREDENTIALS,
        "client_kwargs": {"region_name": "us-east-1"},
        **extra,
    }


@pytest.fixture
def bucket(moto_endpoint: str) -> str:
    """A new, empty bucket on the moto server."""
    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    client = boto3.client(
        "s3",
        endpoint_url=moto_endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )
    client.create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3_client(moto_endpoint: str) -> Any:
    """A plain boto3 client of the test server, to look at buckets behind the storage's back."""
    return boto3.client(
        "s3",
        endpoint_url=moto_endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )


@pytest.fixture
def proxy(moto_endpoint: str) -> Iterator[FaultProxy]:
    """A fault-injecting proxy in front of the moto server."""
    host, port = moto_endpoint.removeprefix("http://").split(":")
    with FaultProxy((host, int(port))) as running:
        yield running


@pytest.fixture
def memory_url() -> Iterator[str]:
    """A memory:// root of its own, emptied afterwards (the memory store is process-wide)."""
    root = f"/planaria-test-{uuid.uuid4().hex[:12]}"
    yield f"memory://{root}/ckpts"
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root, recursive=True)
