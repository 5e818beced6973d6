"""A committer SIGKILLed half way through copying a step on S3: readers never see the step, and
committing it again finishes the job."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest
from conftest import s3_options
from fsspec_helpers import FaultProxy

from planaria_fsspec import FsspecStorage, FsspecStorageOptions

OBJECTS = 24

_COMMITTER = textwrap.dedent(
    """
    import json, sys
    from planaria.testing.storage import build_storage

    storage = build_storage((sys.argv[1], json.loads(sys.argv[2])))
    for rank in range(int(sys.argv[3])):
        storage.write(f"step-3.partial/rank-{rank}.bin", [f"shard {rank}".encode() * 100])
    print("WRITTEN", flush=True)
    storage.commit("step-3.partial", "step-3")
    print("COMMITTED", flush=True)
    """
)


def _keys(client: Any, bucket: str, prefix: str) -> list[str]:
    response = client.list_objects_v2(Bucket=bucket, Prefix=prefix)
    return [item["Key"] for item in response.get("Contents", [])]


def test_a_commit_killed_half_way_stays_invisible(
    proxy: FaultProxy, bucket: str, moto_endpoint: str, s3_client: Any
) -> None:
    url = f"s3://{bucket}/run"
    storage = FsspecStorage(
        FsspecStorageOptions(url=url, storage_options=s3_options(moto_endpoint))
    )
    storage.write("step-2/rank-0.bin", [b"the previous step"])
    proxy.copy_delay = 0.4  # server-side copies are slow: the committer dies among them
    spec = {"url": url, "storage_options": s3_options(proxy.endpoint)}
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _COMMITTER,
            "planaria_fsspec:FsspecStorage",
            json.dumps(spec),
            str(OBJECTS),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == b"WRITTEN", (
            child.stderr.read() if child.stderr else ""
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if _keys(s3_client, bucket, "run/step-3/"):
                break
            time.sleep(0.05)
        else:
            pytest.fail("the committer never started copying")
        child.send_signal(signal.SIGKILL)
        child.communicate(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate(timeout=10)
    assert child.returncode == -signal.SIGKILL

    copied = _keys(s3_client, bucket, "run/step-3/")
    assert 0 < len(copied) < OBJECTS, "the kill must land between the first and the last copy"
    assert _keys(s3_client, bucket, "run/.planaria-pending.step-3")
    first = copied[0].removeprefix("run/")

    # What a reader sees: the previous step, the partial one, never the half-copied one.
    assert storage.list("") == ["step-2", "step-3.partial"]
    assert storage.list("step-3") == []
    for key in (first, "step-3/rank-0.bin"):
        with pytest.raises(FileNotFoundError):
            storage.read(key)
        with pytest.raises(FileNotFoundError):
            storage.size(key)
    assert storage.read("step-2/rank-0.bin") == b"the previous step"

    # The step is committed again from its partial copy, and only then visible, whole.
    storage.commit("step-3.partial", "step-3")
    assert storage.list("") == ["step-2", "step-3"]
    assert storage.list("step-3") == sorted(f"rank-{r}.bin" for r in range(OBJECTS))
    for rank in range(OBJECTS):
        assert storage.read(f"step-3/rank-{rank}.bin") == f"shard {rank}".encode() * 100
    assert not _keys(s3_client, bucket, "run/.planaria-pending")
    assert not _keys(s3_client, bucket, "run/step-3.partial/")


def test_a_stale_marker_also_hides_a_prefix_from_delete(
    moto_endpoint: str, bucket: str, s3_client: Any
) -> None:
    """A delete that died after hiding its prefix: the prefix stays hidden until deleted again."""
    storage = FsspecStorage(
        FsspecStorageOptions(url=f"s3://{bucket}/run", storage_options=s3_options(moto_endpoint))
    )
    storage.write("step-1/a", [b"a"])
    storage.write("step-1/b", [b"b"])
    s3_client.put_object(Bucket=bucket, Key="run/.planaria-pending.step-1", Body=b"delete\n")
    s3_client.delete_object(Bucket=bucket, Key="run/step-1/a")
    assert storage.list("") == []
    with pytest.raises(FileNotFoundError):
        storage.read("step-1/b")
    storage.delete("step-1")
    assert _keys(s3_client, bucket, "run/") == []
