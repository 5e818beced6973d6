"""Registers the ``fsspec`` checkpoint storage through the ``planaria`` entry-point group."""

from __future__ import annotations

from collections.abc import Iterator

from planaria.plugin import CheckpointStorageRecord, hookimpl
from planaria_fsspec.options import FsspecStorageOptions
from planaria_fsspec.storage import FsspecStorage


@hookimpl
def planaria_checkpoint_storages() -> Iterator[CheckpointStorageRecord]:
    yield CheckpointStorageRecord(
        name="fsspec",
        factory=FsspecStorage,
        options=FsspecStorageOptions,
        summary="checkpoints on any fsspec URL (s3://, gs://, az://, file://); marker commits",
    )
