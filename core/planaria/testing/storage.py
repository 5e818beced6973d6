"""The conformance suite of checkpoint storage targets
(:class:`~planaria.storage.api.CheckpointStorage` subclasses).

Every storage plugin, built in or third party, should pass it. Subclass
:class:`StorageConformance` in a test module (the class name must start with ``Test`` for pytest
to collect it) and provide two fixtures:

``storage``
    a fresh, empty storage instance for one test.
``storage_factory_spec``
    how to build *the same* storage (same location) in another process, for the crash test:
    ``("package.module:StorageClass", {options as JSON-able values})``. The class's options model
    is taken from its generic parameter (``class MyStore(CheckpointStorage[MyOptions])``).
    ``"package.module:function"`` also works: a callable that takes the options dict and returns
    a storage.

Example::

    import pytest

    from planaria.testing import StorageConformance, build_storage
    from my_plugin.store import MyStore, MyStoreOptions


    class TestMyStore(StorageConformance):
        @pytest.fixture
        def storage_factory_spec(self, tmp_path):
            return ("my_plugin.store:MyStore", {"url": f"file://{tmp_path}/store"})

        @pytest.fixture
        def storage(self, storage_factory_spec):
            return build_storage(storage_factory_spec)  # or MyStore(MyStoreOptions(...))

Keep objects small where the store allows: the suite writes one 32 MiB object and otherwise
only a few bytes per key.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import random
import select
import signal
import subprocess
import sys
import textwrap
import typing
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from pydantic import BaseModel

from planaria.errors import StorageError
from planaria.storage.api import CheckpointStorage

StorageFactorySpec = tuple[str, dict[str, Any]]
"""``("package.module:Class", options)``: how to rebuild a storage in another process."""

AnyStorage = CheckpointStorage[Any]

MIB = 1 << 20

INVALID_KEYS = [
    "",
    "/abs/key",
    "../escape",
    "step-1/../../escape",
    "a//b",
    "trailing/",
    "nul\x00byte",
]


def _options_model(cls: type) -> type[BaseModel] | None:
    for klass in cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            if typing.get_origin(base) is CheckpointStorage:
                (arg,) = typing.get_args(base)
                if isinstance(arg, type) and issubclass(arg, BaseModel):
                    return arg
    return None


def build_storage(spec: StorageFactorySpec) -> AnyStorage:
    """Build a storage from ``("module:attr", options)`` (see the module docstring)."""
    target, options = spec
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ValueError(f"storage factory {target!r} must read 'package.module:Name'")
    factory: Any = getattr(importlib.import_module(module_name), attr)
    if isinstance(factory, type) and issubclass(factory, CheckpointStorage):
        model = _options_model(factory)
        if model is None:
            raise ValueError(
                f"cannot find the options model of {target}: declare it as "
                f"class {factory.__name__}(CheckpointStorage[MyOptions])"
            )
        storage: Any = factory(model.model_validate(options))
    else:
        storage = factory(options)
    if not isinstance(storage, CheckpointStorage):
        raise TypeError(f"{target} built {storage!r}, not a CheckpointStorage")
    return storage


# The child of the crash test: commit step-1, then block in the middle of writing step-2.
_CRASH_CHILD = textwrap.dedent(
    """
    import json, sys, time
    from planaria.testing.storage import build_storage

    storage = build_storage((sys.argv[1], json.loads(sys.argv[2])))
    storage.write("step-1.partial/a.bin", [b"alpha" * 1000])
    storage.write("step-1.partial/b.bin", [b"beta" * 1000])
    storage.commit("step-1.partial", "step-1")
    storage.write("step-2.partial/a.bin", [b"gamma" * 1000])

    def chunks():
        yield b"delta" * 100_000
        print("READY", flush=True)
        while True:
            time.sleep(60)
        yield b""

    storage.write("step-2.partial/b.bin", chunks())
    """
)


def _pattern(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


class StorageConformance:
    """Tests every :class:`~planaria.storage.api.CheckpointStorage` must pass (module doc)."""

    @pytest.fixture
    def storage(self) -> AnyStorage:
        pytest.fail("a StorageConformance subclass must define a `storage` fixture")

    @pytest.fixture
    def storage_factory_spec(self) -> StorageFactorySpec:
        pytest.fail(
            "a StorageConformance subclass must define a `storage_factory_spec` fixture: "
            "('package.module:Class', {options}) building the same storage in a child process"
        )

    # -- objects ---------------------------------------------------------------------------------

    def test_round_trip_bytes(self, storage: AnyStorage) -> None:
        assert storage.write("obj", [b"hello"]) == 5
        assert storage.read("obj") == b"hello"

    def test_round_trip_memoryview_and_many_chunks(self, storage: AnyStorage) -> None:
        data = _pattern(1, 10_000)
        view = memoryview(bytearray(data))
        chunks: list[bytes | memoryview] = [view[:1000], data[1000:4000], view[4000:], b""]
        assert storage.write("dir/sub/obj.bin", chunks) == len(data)
        assert storage.read("dir/sub/obj.bin") == data

    def test_empty_object(self, storage: AnyStorage) -> None:
        assert storage.write("empty", []) == 0
        assert storage.read("empty") == b""
        assert storage.size("empty") == 0

    def test_range_reads(self, storage: AnyStorage) -> None:
        data = bytes(range(256)) * 4
        storage.write("r", [data])
        assert storage.read("r", 0, 10) == data[:10]
        assert storage.read("r", 100) == data[100:]
        assert storage.read("r", 100, 28) == data[100:128]
        assert storage.read("r", 1000, 100) == data[1000:]
        assert storage.read("r", len(data)) == b""
        assert storage.read("r", len(data) + 50, 10) == b""
        assert storage.read("r", 5, 0) == b""

    def test_size(self, storage: AnyStorage) -> None:
        storage.write("step-1/x", [b"a" * 1234, memoryview(b"b" * 10)])
        assert storage.size("step-1/x") == 1244

    def test_missing_key(self, storage: AnyStorage) -> None:
        with pytest.raises(FileNotFoundError):
            storage.read("nope")
        with pytest.raises(FileNotFoundError):
            storage.read("no/such/dir/obj", 10, 5)
        with pytest.raises(FileNotFoundError):
            storage.size("nope")

    def test_overwrite(self, storage: AnyStorage) -> None:
        storage.write("k", [b"first version, long"])
        storage.write("k", [b"second"])
        assert storage.read("k") == b"second"
        assert storage.size("k") == 6
        assert storage.list("") == ["k"]

    # -- listing and deleting ----------------------------------------------------------------

    def test_list_one_level_sorted(self, storage: AnyStorage) -> None:
        assert storage.list("") == []
        for key in ["b/2", "a", "b/1", "b/c/deep", "c/x", "step-10/x", "step-9/x"]:
            storage.write(key, [b"."])
        assert storage.list("") == ["a", "b", "c", "step-10", "step-9"]
        assert storage.list("b") == ["1", "2", "c"]
        assert storage.list("b/c") == ["deep"]
        assert storage.list("missing") == []
        assert storage.list("missing/deeper") == []

    def test_delete(self, storage: AnyStorage) -> None:
        for key in ["keep", "gone", "tree/a", "tree/sub/b", "treehouse"]:
            storage.write(key, [b"."])
        storage.delete("gone")
        assert storage.list("") == ["keep", "tree", "treehouse"]
        storage.delete("tree")
        assert storage.list("") == ["keep", "treehouse"]
        with pytest.raises(FileNotFoundError):
            storage.read("tree/sub/b")
        assert storage.read("treehouse") == b"."
        storage.delete("gone")  # absent: fine
        storage.delete("never/was/here")
        assert storage.read("keep") == b"."

    # -- commits -------------------------------------------------------------------------------

    def test_commit(self, storage: AnyStorage) -> None:
        storage.write("step-5.partial/rank-0.bin", [b"zero"])
        storage.write("step-5.partial/rank-1.bin", [b"one"])
        storage.write("step-5.partial/meta/manifest.json", [b"{}"])
        storage.commit("step-5.partial", "step-5")
        assert storage.list("") == ["step-5"]
        assert storage.list("step-5") == ["meta", "rank-0.bin", "rank-1.bin"]
        assert storage.read("step-5/rank-0.bin") == b"zero"
        assert storage.read("step-5/rank-1.bin") == b"one"
        assert storage.read("step-5/meta/manifest.json") == b"{}"
        assert storage.list("step-5.partial") == []
        with pytest.raises(FileNotFoundError):
            storage.read("step-5.partial/rank-0.bin")

    def test_commit_onto_existing_final(self, storage: AnyStorage) -> None:
        storage.write("s.partial/a", [b"old"])
        storage.commit("s.partial", "s")
        storage.write("s.partial/b", [b"new"])
        with pytest.raises(StorageError, match="already exists"):
            storage.commit("s.partial", "s")
        assert storage.list("s") == ["a"]
        assert storage.read("s/a") == b"old"
        assert storage.read("s.partial/b") == b"new"

    # -- keys ----------------------------------------------------------------------------------

    @pytest.mark.parametrize("key", INVALID_KEYS)
    def test_invalid_keys(self, storage: AnyStorage, key: str) -> None:
        with pytest.raises(StorageError):
            storage.write(key, [b"x"])
        with pytest.raises(StorageError):
            storage.read(key)
        with pytest.raises(StorageError):
            storage.size(key)
        with pytest.raises(StorageError):
            storage.delete(key)
        storage.write("ok.partial/x", [b"x"])
        with pytest.raises(StorageError):
            storage.commit("ok.partial", key)
        with pytest.raises(StorageError):
            storage.commit(key, "ok")
        assert storage.read("ok.partial/x") == b"x"

    # -- scale and concurrency ---------------------------------------------------------------

    def test_large_object(self, storage: AnyStorage) -> None:
        block = _pattern(7, MIB)
        written = hashlib.sha256()

        def chunks() -> Iterator[bytes | memoryview]:
            for i in range(32):
                chunk = memoryview(block) if i % 2 else bytes([i]) + block[1:]
                written.update(chunk)
                yield chunk

        assert storage.write("big/blob", chunks()) == 32 * MIB
        assert storage.size("big/blob") == 32 * MIB
        assert hashlib.sha256(storage.read("big/blob")).hexdigest() == written.hexdigest()
        assert storage.read("big/blob", 3 * MIB + 5, 10) == block[5:15]

    def test_concurrent_steps(self, storage: AnyStorage) -> None:
        def save(step: int) -> None:
            for rank in range(3):
                storage.write(f"step-{step}.partial/rank-{rank}", [f"{step}:{rank}".encode()])
            storage.commit(f"step-{step}.partial", f"step-{step}")

        with ThreadPoolExecutor(max_workers=4) as pool:
            list(pool.map(save, range(4)))
        assert storage.list("") == [f"step-{n}" for n in range(4)]
        for step in range(4):
            assert storage.list(f"step-{step}") == ["rank-0", "rank-1", "rank-2"]
            for rank in range(3):
                assert storage.read(f"step-{step}/rank-{rank}") == f"{step}:{rank}".encode()

    # -- crashes -------------------------------------------------------------------------------

    def test_atomic_commit_under_crash(
        self, storage: AnyStorage, storage_factory_spec: StorageFactorySpec
    ) -> None:
        target, options = storage_factory_spec
        proc = subprocess.Popen(
            [sys.executable, "-c", _CRASH_CHILD, target, json.dumps(options)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        try:
            assert proc.stdout is not None
            ready, _, _ = select.select([proc.stdout], [], [], 60)
            line = proc.stdout.readline() if ready else b""
            if line.strip() != b"READY":
                proc.kill()
                _, err = proc.communicate(timeout=10)
                pytest.fail(f"crash child did not get ready:\n{err.decode(errors='replace')}")
            proc.send_signal(signal.SIGKILL)
            proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=10)
        assert proc.returncode == -signal.SIGKILL

        assert storage.read("step-1/a.bin") == b"alpha" * 1000
        assert storage.read("step-1/b.bin") == b"beta" * 1000
        assert storage.list("step-1") == ["a.bin", "b.bin"]
        assert "step-2" not in storage.list("")
        assert set(storage.list("")) <= {"step-1", "step-2.partial"}
        assert storage.list("step-2") == []
        with pytest.raises(FileNotFoundError):
            storage.read("step-2/a.bin")
        with pytest.raises(FileNotFoundError):
            storage.read("step-2.partial/b.bin")  # the torn object never became visible
