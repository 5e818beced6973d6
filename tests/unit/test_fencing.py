"""Fencing in the checkpoint storage: once the master fenced a round out, nothing saved in it
is committed, and a step's shards must all be of the round that commits it."""

from __future__ import annotations

import pytest

from planaria.checkpoint.persisted import PersistedCheckpoints
from planaria.errors import CheckpointCorruptError, FencedError
from planaria.storage.local import LocalStorage, LocalStorageOptions

META = {"tensors": [], "tree": {}, "step": 0}


def _store(tmp_path) -> PersistedCheckpoints:
    return PersistedCheckpoints(LocalStorage(LocalStorageOptions(path=tmp_path)))


def _shards(store: PersistedCheckpoints, step: int, generations: list[int]) -> None:
    for rank, generation in enumerate(generations):
        meta = {**META, "step": step}
        data = memoryview(bytes([rank]) * 64)
        store.write_shard(step, rank, len(generations), data, meta, generation)


def test_a_fenced_round_cannot_commit_and_a_newer_one_can(tmp_path):
    store = _store(tmp_path)
    _shards(store, 10, [1, 1])
    store.commit(10, 2, generation=1)
    assert store.committed_steps() == [10]
    store.fence(2)
    assert store.fenced_at() == 2
    _shards(store, 20, [1, 1])  # the lost node's round, still saving somewhere cut off
    with pytest.raises(FencedError, match="fenced rounds before 2"):
        store.commit(20, 2, generation=1)
    assert store.committed_steps() == [10]
    _shards(store, 20, [2, 2])  # the round without it
    manifest = store.commit(20, 2, generation=2)
    assert manifest.generation == 2 and sorted(store.committed_steps()) == [10, 20]
    # A fence never goes back.
    store.fence(1)
    assert store.fenced_at() == 2


def test_shards_of_another_round_are_not_committed_with_this_one(tmp_path):
    store = _store(tmp_path)
    _shards(store, 30, [3, 2])  # rank 1's shard was written by a node of round 2
    with pytest.raises(FencedError, match="saved in round 2, not in round 3"):
        store.commit(30, 2, generation=3)
    assert store.committed_steps() == []


def test_a_damaged_fence_record_is_an_error_not_no_fence(tmp_path):
    store = _store(tmp_path)
    (tmp_path / "fence").write_text('{"generation": "two"}')
    with pytest.raises(CheckpointCorruptError, match="not a fence record"):
        store.fenced_at()
