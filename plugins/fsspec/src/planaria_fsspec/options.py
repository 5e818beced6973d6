"""The ``fsspec`` storage's section of a config file: ``checkpoint.storage.options``."""

from __future__ import annotations

import re
from typing import Any

import fsspec
from pydantic import BaseModel, ByteSize, ConfigDict, Field, field_validator, model_validator

from planaria.durations import Duration

MIB = 1 << 20
_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://(.*)$")


class FsspecStorageOptions(BaseModel):
    """Where checkpoints live (an fsspec URL), how to reach it, and how hard to retry."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = Field(
        description="the root of the checkpoints: s3://bucket/prefix, gs://..., az://..., "
        "file:///path or memory://name"
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="keyword arguments of the fsspec file system (endpoint_url, key, secret, "
        "anon, client_kwargs ...)",
    )
    retries: int = Field(
        default=5, ge=0, le=100, description="retries of an operation after a transient error"
    )
    retry_backoff: Duration = Field(
        default=0.5, description="the first retry's delay; it doubles each time, with jitter"
    )
    retry_backoff_max: Duration = Field(default=30.0, description="the longest retry delay")
    part_size: ByteSize = Field(
        default=ByteSize(16 * MIB),
        ge=5 * MIB,
        le=5 * 1024 * MIB,
        description="size of the parts a large object is uploaded in (5MiB to 5GiB)",
    )

    @field_validator("url")
    @classmethod
    def _known_protocol(cls, value: str) -> str:
        url = value.strip()
        if "::" in url:
            raise ValueError(
                f"chained URL {value!r} is not supported: caching layers would break the "
                "durability of writes; give the store's own URL"
            )
        match = _SCHEME.match(url)
        if match is None:
            raise ValueError(
                f"URL {value!r} has no protocol: write it as s3://bucket/prefix, "
                "gs://bucket/prefix, az://container/prefix or file:///absolute/path"
            )
        protocol, rest = match.group(1).lower(), match.group(2)
        known = set(fsspec.available_protocols())
        if protocol not in known:
            raise ValueError(
                f"unknown protocol {protocol!r} in {value!r}; fsspec knows: "
                + ", ".join(sorted(p for p in known if len(p) > 1))
            )
        if not rest.strip("/"):
            raise ValueError(
                f"URL {value!r} names no location: add a bucket or path, e.g. {protocol}://name"
            )
        return f"{protocol}://{rest.rstrip('/') or '/'}"

    @model_validator(mode="after")
    def _ordered_backoff(self) -> FsspecStorageOptions:
        if self.retry_backoff > self.retry_backoff_max:
            raise ValueError(
                f"retry_backoff ({self.retry_backoff}s) is longer than retry_backoff_max "
                f"({self.retry_backoff_max}s)"
            )
        return self
