"""The ``local`` checkpoint storage: the conformance suite plus what is specific to a directory."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from pydantic import ValidationError

from planaria.errors import StorageError
from planaria.plugin.manager import PluginManager
from planaria.plugin.records import PluginKind
from planaria.storage.api import CheckpointStorageRecord
from planaria.storage.local import LocalStorage, LocalStorageOptions
from planaria.testing import StorageConformance, StorageFactorySpec, build_storage


class TestLocalStorage(StorageConformance):
    @pytest.fixture
    def storage_factory_spec(self, tmp_path: Path) -> StorageFactorySpec:
        return ("planaria.storage.local:LocalStorage", {"path": str(tmp_path / "store")})

    @pytest.fixture
    def storage(self, storage_factory_spec: StorageFactorySpec) -> LocalStorage:
        storage = build_storage(storage_factory_spec)
        assert isinstance(storage, LocalStorage)
        return storage


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_file_and_dir_modes(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        storage = LocalStorage(LocalStorageOptions(path=tmp_path / "root"))
        storage.write("step-1.partial/sub/rank-0.bin", [b"x"])
        storage.commit("step-1.partial", "step-1")
    finally:
        os.umask(old)
    root = tmp_path / "root"
    assert _mode(root) == 0o700
    assert _mode(root / "step-1") == 0o700
    assert _mode(root / "step-1" / "sub") == 0o700
    assert _mode(root / "step-1" / "sub" / "rank-0.bin") == 0o600


def test_no_temp_files_left(tmp_path: Path) -> None:
    storage = LocalStorage(LocalStorageOptions(path=tmp_path, fsync=False))
    storage.write("a/b", [b"1", b"2"])
    assert sorted(os.listdir(tmp_path / "a")) == ["b"]


def test_failed_write_leaves_nothing(tmp_path: Path) -> None:
    storage = LocalStorage(LocalStorageOptions(path=tmp_path))
    storage.write("obj", [b"old"])

    def chunks() -> list[bytes]:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        storage.write("obj", (c for c in chunks()))
    assert storage.read("obj") == b"old"
    assert os.listdir(tmp_path) == ["obj"]


def test_commit_single_file_and_missing_partial(tmp_path: Path) -> None:
    storage = LocalStorage(LocalStorageOptions(path=tmp_path))
    storage.write("latest.partial", [b"step-3"])
    storage.commit("latest.partial", "nested/latest")
    assert storage.read("nested/latest") == b"step-3"
    assert storage.list("") == ["nested"]
    with pytest.raises(StorageError, match="does not exist"):
        storage.commit("nothing.partial", "nothing")


def test_error_names_the_key(tmp_path: Path) -> None:
    storage = LocalStorage(LocalStorageOptions(path=tmp_path))
    with pytest.raises(StorageError, match=r"'\.\./x'.*escapes the storage root"):
        storage.write("../x", [b""])
    with pytest.raises(StorageError, match="invalid range"):
        storage.read("x", -1)


def test_relative_path_is_fixed_at_creation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    storage = LocalStorage(LocalStorageOptions())
    assert storage.root == tmp_path / "checkpoints"
    monkeypatch.chdir("/")
    storage.write("x", [b"1"])
    assert (tmp_path / "checkpoints" / "x").read_bytes() == b"1"


def test_entry_point_resolution() -> None:
    record = PluginManager.from_entry_points().resolve(PluginKind.CHECKPOINT_STORAGE, "local")
    assert isinstance(record, CheckpointStorageRecord)
    assert record.factory is LocalStorage
    assert record.options is LocalStorageOptions
    assert record.summary


def test_options_validation(tmp_path: Path) -> None:
    opts = LocalStorageOptions.model_validate({"path": str(tmp_path), "fsync": False})
    assert opts.path == tmp_path and opts.fsync is False
    assert LocalStorageOptions().path == Path("checkpoints")
    assert LocalStorageOptions().fsync is True
    with pytest.raises(ValidationError, match="extra"):
        LocalStorageOptions.model_validate({"pth": "x"})
    with pytest.raises(ValidationError):
        LocalStorageOptions.model_validate({"fsync": "sometimes"})
