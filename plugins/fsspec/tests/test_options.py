"""The options model: defaults, normalised URLs, and errors that name what is wrong."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
from pydantic import ValidationError

from planaria.errors import StorageError
from planaria_fsspec import FsspecStorage, FsspecStorageOptions


def test_defaults_and_normalised_url() -> None:
    options = FsspecStorageOptions(url=" S3://bucket/ckpts/ ")
    assert options.url == "s3://bucket/ckpts"
    assert options.storage_options == {}
    assert options.retries == 5
    assert options.retry_backoff == 0.5 and options.retry_backoff_max == 30.0
    assert options.part_size == 16 << 20
    tuned = FsspecStorageOptions(
        url="gs://b", retries=0, retry_backoff="200ms", retry_backoff_max="1m", part_size="64MiB"
    )
    assert (tuned.retries, tuned.retry_backoff, tuned.retry_backoff_max) == (0, 0.2, 60.0)
    assert tuned.part_size == 64 << 20


@pytest.mark.parametrize(
    ("options", "field", "message"),
    [
        ({}, "url", "Field required"),
        ({"url": "bucket/ckpts"}, "url", "has no protocol"),
        ({"url": "nosuch://bucket"}, "url", "unknown protocol 'nosuch'"),
        ({"url": "s3://"}, "url", "names no location"),
        ({"url": "simplecache::s3://b/c"}, "url", "chained URL"),
        ({"url": "s3://b", "bucket": "b"}, "bucket", "Extra inputs are not permitted"),
        ({"url": "s3://b", "retries": -1}, "retries", "greater than or equal to 0"),
        ({"url": "s3://b", "retry_backoff": "fast"}, "retry_backoff", "invalid duration"),
        ({"url": "s3://b", "retry_backoff": "1m"}, "", "longer than retry_backoff_max"),
        ({"url": "s3://b", "part_size": "1MiB"}, "part_size", "greater than or equal"),
        ({"url": "s3://b", "storage_options": "key=x"}, "storage_options", "dictionary"),
    ],
)
def test_invalid_options(options: dict[str, Any], field: str, message: str) -> None:
    with pytest.raises(ValidationError) as caught:
        FsspecStorageOptions.model_validate(options)
    errors = caught.value.errors()
    assert len(errors) == 1
    assert ".".join(str(p) for p in errors[0]["loc"]) == field
    assert message in errors[0]["msg"]


@pytest.mark.skipif(importlib.util.find_spec("gcsfs") is not None, reason="gcsfs is installed here")
def test_a_store_whose_library_is_missing_says_what_to_install() -> None:
    with pytest.raises(StorageError, match="gs://bucket/ckpts") as caught:
        FsspecStorage(FsspecStorageOptions(url="gs://bucket/ckpts"))
    assert "gcsfs" in str(caught.value)


def test_storage_options_reach_the_file_system() -> None:
    storage = FsspecStorage(
        FsspecStorageOptions(
            url="s3://bucket/x",
            storage_options={"endpoint_url": "http://127.0.0.1:9", "anon": True},
        )
    )
    assert storage.fs.anon is True
    assert storage.fs.endpoint_url == "http://127.0.0.1:9"
    assert storage.root == "bucket/x"
