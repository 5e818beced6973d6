"""The checkpoint's life under faults: a killed persister, corrupt manifests and steps, a full
disk, and what the job's end says about its last checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from planaria import errors  # noqa: E402
from planaria.checkpoint import Checkpointer  # noqa: E402
from planaria.checkpoint.persisted import PersistedCheckpoints, checksum  # noqa: E402
from planaria.shm import make_temp_dir, name_prefix, remove_dir  # noqa: E402
from planaria.storage.local import LocalStorage, LocalStorageOptions  # noqa: E402
from planaria.testing.jobs import EXAMPLE, MARK, events, job, marked_processes, run  # noqa: E402
from support.checkpoints import Node, ask, equal_trees, partials, store_at  # noqa: E402


@pytest.fixture(autouse=True)
def standalone(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("PLANARIA_CKPT_") or name in ("RANK", "WORLD_SIZE"):
            monkeypatch.delenv(name)


def full(step: int, n: int = 4096) -> dict[str, Any]:
    return {"w": torch.full((n,), float(step)), "step": step}


def committed(root: Path, *steps: int, keep_last: int = 5) -> None:
    ckpt = Checkpointer(root, keep_last=keep_last)
    try:
        for step in steps:
            ckpt.save(step, full(step), persist=True)
        ckpt.wait()
    finally:
        ckpt.close()


def flip(path: Path, at: int = 100) -> None:
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x01
    path.write_bytes(bytes(raw))


def load_quietly(root: Path, **kwargs: Any) -> tuple[Any, list[str]]:
    loader = Checkpointer(root, **kwargs)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            restored = loader.load()
    finally:
        loader.close()
    return restored, [str(w.message) for w in caught]


# -- malformed manifests and shard records ---------------------------------------------------


def test_a_manifest_whose_key_changed_falls_back_to_the_previous_step(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    committed(root, 10, 20)
    manifest = root / "step-20" / "manifest.json"
    text = manifest.read_text()
    assert text.count('"checksum"') == 2
    manifest.write_text(text.replace('"checksum"', '"checksul"', 1))  # one byte flipped
    restored, caught = load_quietly(root)
    assert restored is not None and restored[0] == 10
    assert equal_trees(restored[1], full(10))
    assert any("skipping checkpoint step-20: step-20/manifest.json" in m for m in caught), caught


def test_a_malformed_shard_record_that_its_manifest_vouches_for_falls_back(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    committed(root, 10, 20, 30)
    # Records that are well-formed JSON, listed with their true size and checksum, but wrong:
    # no tensor layout (step 30), and one that claims another rank (step 20).
    for step, change in (
        (30, lambda r: r["meta"].pop("tensors")),
        (20, lambda r: r.update(rank=3)),
    ):
        record_path = root / f"step-{step}" / "rank-0.json"
        record = json.loads(record_path.read_bytes())
        change(record)
        raw = json.dumps(record).encode()
        record_path.write_bytes(raw)
        manifest_path = root / f"step-{step}" / "manifest.json"
        manifest = json.loads(manifest_path.read_text())
        size, digest = checksum([raw])
        manifest["files"]["rank-0.json"] = {"size": size, "checksum": digest}
        manifest_path.write_text(json.dumps(manifest))
    restored, caught = load_quietly(root)
    assert restored is not None and restored[0] == 10, caught
    assert equal_trees(restored[1], full(10))
    assert any("step-30/rank-0.json" in m for m in caught), caught
    assert any("step-20/rank-0.json" in m for m in caught), caught


MALFORMED = {
    "not JSON": lambda m: "{" + json.dumps(m)[:40],
    "not UTF-8": lambda m: b"\xff\xfe" + json.dumps(m).encode(),
    "files not a mapping": lambda m: {**m, "files": list(m["files"].values())},
    "a negative size": lambda m: _set(m, "rank-0.bin", "size", -1),
    "a size of the wrong type": lambda m: _set(m, "rank-0.bin", "size", "4096"),
    "a wrong size": lambda m: _set(m, "rank-0.bin", "size", 4095),
    "a checksum that is not hex": lambda m: _set(m, "rank-0.bin", "checksum", "z" * 16),
    "a missing checksum": lambda m: _drop(m, "rank-0.json", "checksum"),
    "a world of 0": lambda m: {**m, "world": 0},
    "a world as a float": lambda m: {**m, "world": 1.0},
    "another step": lambda m: {**m, "step": 10},
    "another format": lambda m: {**m, "format": "planaria-flash/2"},
    "an unknown key": lambda m: {**m, "extra": 1},
    "a list": lambda m: [m],
    "a shard left out": lambda m: {**m, "files": {"rank-0.json": m["files"]["rank-0.json"]}},
}


def _set(manifest: dict[str, Any], name: str, key: str, value: Any) -> dict[str, Any]:
    manifest["files"][name][key] = value
    return manifest


def _drop(manifest: dict[str, Any], name: str, key: str) -> dict[str, Any]:
    del manifest["files"][name][key]
    return manifest


@pytest.mark.parametrize("what", sorted(MALFORMED))
def test_a_malformed_manifest_is_a_step_that_does_not_verify(
    two_steps: tuple[Path, bytes], what: str
) -> None:
    root, original = two_steps
    mutated = MALFORMED[what](json.loads(original))
    raw = mutated if isinstance(mutated, bytes) else None
    if raw is None:
        raw = mutated.encode() if isinstance(mutated, str) else json.dumps(mutated).encode()
    (root / "step-20" / "manifest.json").write_bytes(raw)
    restored, caught = load_quietly(root)
    assert restored is not None and restored[0] == 10, what
    assert equal_trees(restored[1], full(10))
    assert any("skipping checkpoint step-20: step-20/" in m for m in caught), caught


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=6,
)


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from _paths(value, (*prefix, key))
    elif isinstance(obj, list):
        for index, value in enumerate(obj):
            yield from _paths(value, (*prefix, index))


def _mutate(obj: Any, path: tuple[Any, ...], how: str, value: Any, key: str) -> Any:
    if not path:
        return value
    parent = obj
    for part in path[:-1]:
        parent = parent[part]
    last = path[-1]
    if how == "delete":
        del parent[last]
    elif how == "rename" and isinstance(parent, dict):
        parent[key] = parent.pop(last)
    elif how == "negate" and isinstance(parent[last], (int, float)):
        parent[last] = -parent[last] - 1
    else:
        parent[last] = value
    return obj


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes]:
    root = tmp_path_factory.mktemp("manifests") / "ckpt"
    for name in ("RANK", "WORLD_SIZE"):
        os.environ.pop(name, None)
    committed(root, 10, 20)
    return root, (root / "step-20" / "manifest.json").read_bytes()


def _loads_same_or_falls_back(root: Path, mutated: bytes) -> None:
    (root / "step-20" / "manifest.json").write_bytes(mutated)
    restored, _ = load_quietly(root)  # nothing but a step or a fallback may come out
    assert restored is not None
    step, state = restored
    assert step in (10, 20)
    assert equal_trees(state, full(step))


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_any_byte_mutation_of_a_manifest_loads_the_same_state_or_falls_back(
    two_steps: tuple[Path, bytes], data: st.DataObject
) -> None:
    root, original = two_steps
    raw = bytearray(original)
    at = data.draw(st.integers(0, len(raw) - 1))
    how = data.draw(st.sampled_from(["flip", "set", "delete", "insert", "truncate"]))
    byte = data.draw(st.integers(0, 255))
    if how == "flip":
        raw[at] ^= 1 << data.draw(st.integers(0, 7))
    elif how == "set":
        raw[at] = byte
    elif how == "delete":
        del raw[at]
    elif how == "insert":
        raw.insert(at, byte)
    else:
        del raw[at:]
    _loads_same_or_falls_back(root, bytes(raw))


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_any_structural_mutation_of_a_manifest_loads_the_same_state_or_falls_back(
    two_steps: tuple[Path, bytes], data: st.DataObject
) -> None:
    root, original = two_steps
    obj = json.loads(original)
    path = data.draw(st.sampled_from(list(_paths(obj))))
    how = data.draw(st.sampled_from(["delete", "rename", "negate", "replace"]))
    if how == "delete" and not path:
        how = "replace"
    value = data.draw(json_values)
    key = data.draw(st.text(max_size=10))
    mutated = _mutate(obj, path, how, value, key)
    _loads_same_or_falls_back(root, json.dumps(mutated).encode())


# -- corrupt steps, retention and require_restore ---------------------------------------------


def test_corrupt_steps_are_never_kept_in_place_of_a_new_good_one(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    committed(root, 7, 11, keep_last=2)
    flip(root / "step-7" / "rank-0.bin")
    flip(root / "step-11" / "rank-0.bin")
    ckpt = Checkpointer(root, keep_last=2)
    try:
        with pytest.warns(UserWarning) as caught:
            assert ckpt.load() is None  # every committed step is corrupt: from scratch
        assert {str(w.message)[:32] for w in caught} >= {
            "skipping checkpoint step-11: ste",
            "skipping checkpoint step-7: step",
        }
        ckpt.save(3, full(3), persist=True)
        ckpt.wait()
        # The new good step is kept although two (corrupt) newer steps are committed.
        assert store_at(root).committed_steps() == [11, 7, 3]
        ckpt.save(7, full(7, 2048), persist=True)  # a corrupt step of the same number...
        ckpt.wait()
    finally:
        ckpt.close()
    restored, caught = load_quietly(root)
    assert restored is not None and restored[0] == 7  # ...is replaced by the good one
    assert equal_trees(restored[1], full(7, 2048))
    assert any("skipping checkpoint step-11" in m for m in caught)
    assert store_at(root).committed_steps() == [11, 7, 3]


def _step_on(store: PersistedCheckpoints, step: int) -> None:
    store.write_shard(step, 0, 1, memoryview(bytes(64)), {"tensors": [], "tree": {}, "step": step})
    store.commit(step, 1)


def test_retention_keeps_the_newest_steps_that_verify(tmp_path: Path) -> None:
    store = PersistedCheckpoints(LocalStorage(LocalStorageOptions(path=tmp_path)), keep_last=2)
    for step in (10, 20, 30):
        _step_on(store, step)
    assert store.committed_steps() == [30, 20]
    (tmp_path / "step-30" / "manifest.json").write_text("{not json")
    _step_on(store, 40)
    # 30 does not verify: 40 and 20 are the two kept; 30 stays while it is newer than them.
    assert store.committed_steps() == [40, 30, 20]
    _step_on(store, 50)
    assert store.committed_steps() == [50, 40]
    (tmp_path / "step-60.partial").mkdir()  # a step that never committed...
    (tmp_path / "step-45.partial").mkdir()
    _step_on(store, 55)
    assert partials(tmp_path) == ["step-60.partial"]  # ...is removed once older than a commit


def test_require_restore_refuses_to_start_from_scratch_over_corrupt_steps(tmp_path: Path) -> None:
    empty, _ = load_quietly(tmp_path / "nothing", require_restore=True)
    assert empty is None  # nothing committed: a fresh start is fine
    root = tmp_path / "ckpt"
    committed(root, 4, 8)
    for step in (4, 8):
        flip(root / f"step-{step}" / "rank-0.bin")
    with pytest.raises(errors.CheckpointRestoreError, match=r"steps 8, 4 .*failed verification"):
        load_quietly(root, require_restore=True)


# -- the persister: its death, its restart, its shutdown -------------------------------------


def test_a_worker_reconnects_to_a_restarted_persister_and_its_steps_are_persisted(
    node: Node, tmp_path: Path
) -> None:
    node.start()
    worker = node.worker(0, 1)
    assert ask(worker, "save 1 1024 1") == "saved 1"
    assert ask(worker, "wait") == "idle"
    node.kill()
    node.start()  # as the agent does
    assert ask(worker, "save 2 1024 1") == "saved 2"  # hit the dead persister, then the new one
    assert ask(worker, "wait") == "idle"
    # A persist in flight when the persister dies: the restarted one is asked again.
    assert ask(worker, "save 3 1024 1") == "saved 3"
    node.kill()
    node.start()
    assert ask(worker, "wait") == "idle"
    assert store_at(tmp_path / "ckpt").committed_steps() == [3, 2, 1]
    assert partials(tmp_path / "ckpt") == []


def test_a_step_that_never_gets_every_shard_gives_way_to_a_newer_one(
    node: Node, tmp_path: Path
) -> None:
    node.start("--commit-timeout", "300")
    rank0, rank1 = node.worker(0, 2), node.worker(1, 2)
    assert ask(rank0, "save 2 1024 1") == "saved 2"
    assert ask(rank1, "save 2 1024 0") == "saved 2"  # rank 1's shard of step 2 never comes
    assert ask(rank0, "save 3 1024 1") == "saved 3"
    assert ask(rank1, "save 3 1024 1") == "saved 3"
    assert ask(rank1, "wait") == "idle"
    assert ask(rank0, "wait", timeout=60) == "idle"  # not after the 300 s commit timeout
    assert store_at(tmp_path / "ckpt").committed_steps() == [3]
    assert partials(tmp_path / "ckpt") == []


def test_a_shard_that_cannot_be_written_ends_its_steps_commit_at_once(small_disk: Path) -> None:
    node = Node(small_disk, small_disk / "ckpt")
    try:
        node.start("--commit-timeout", "300")
        rank0, rank1 = node.worker(0, 2), node.worker(1, 2)
        assert ask(rank0, "save 1 1024 1") == "saved 1"
        assert ask(rank1, "save 1 1024 1") == "saved 1"
        assert ask(rank0, "wait") == "idle"
        assert ask(rank0, "save 2 1024 1") == "saved 2"
        assert ask(rank1, "save 2 2000000 1") == "saved 2"  # 8 MB: the 4 MiB disk is full
        assert ask(rank1, "wait") == "idle"  # managed: the failure is the job's to report
        assert ask(rank0, "wait", timeout=60) == "idle"  # not after the 300 s commit timeout
        assert store_at(small_disk / "ckpt").committed_steps() == [1]
        assert partials(small_disk / "ckpt") == []
    finally:
        node.close()


ORPHANING_PARENT = textwrap.dedent(
    """
    import json, os, subprocess, sys, time, torch
    from planaria.checkpoint import persister
    from planaria.checkpoint import Checkpointer
    directory, storage = sys.argv[1], sys.argv[2]
    socket = directory + "/sock"
    proc = subprocess.Popen(
        persister.command(socket, json.loads(storage), 3, directory), stdout=subprocess.PIPE
    )
    assert proc.stdout.readline().strip() == b"ready"
    os.environ.update(PLANARIA_CKPT_SOCKET=socket, PLANARIA_CKPT_SEGMENT=directory + "/ckpt-0",
                      PLANARIA_CKPT_STORAGE=storage, RANK="0", WORLD_SIZE="2")
    ckpt = Checkpointer()
    for step in range(1, 9):  # rank 1 never comes: every commit waits for its shard
        ckpt.save(step, {"w": torch.full((1024,), float(step))}, persist=True)
        time.sleep(0.05)
    print(proc.pid, flush=True)
    time.sleep(600)
    """
)


def test_a_persister_whose_agent_died_follows_it_promptly(tmp_path: Path) -> None:
    directory = make_temp_dir(name_prefix() + "test-")
    storage = json.dumps({"backend": "local", "options": {"path": str(tmp_path / "ckpt")}})
    parent = subprocess.Popen(
        [sys.executable, "-c", ORPHANING_PARENT, str(directory), storage],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        # save() returns once the shard is in memory: the last persist may still be writing.
        deadline = time.monotonic() + 30
        while len(partials(tmp_path / "ckpt")) < 8 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(partials(tmp_path / "ckpt")) == 8
        parent.kill()
        parent.wait()
        killed = time.monotonic()
        while Path(f"/proc/{pid}").exists() and time.monotonic() - killed < 60:
            status = (
                Path(f"/proc/{pid}/status").read_text() if Path(f"/proc/{pid}").exists() else ""
            )
            if "State:\tZ" in status:
                break
            time.sleep(0.05)
        lived = time.monotonic() - killed
        # Eight commits each waited 5 s for the missing shard: 40 s. One grace for all now.
        assert lived < 15, f"the persister outlived its parent by {lived:.1f}s"
        assert partials(tmp_path / "ckpt") == []  # steps that can never commit are removed
        assert not directory.exists()  # the node's memory went with it
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        remove_dir(directory)


# -- end to end: planaria run -----------------------------------------------------------------


def _train(steps: int, every: int = 4) -> str:
    command = [sys.executable, str(EXAMPLE), "--steps", str(steps), "--ckpt-every", str(every)]
    return f"job.command={json.dumps(command)}"


def _persisters(mark_: str) -> dict[str, int]:
    """The running persisters of a run, by node id."""
    found = {}
    for pid in marked_processes(mark_):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"planaria.checkpoint.persister" in cmdline:
            node_id = next(
                (
                    e.split(b"=", 1)[1].decode()
                    for e in environ
                    if e.startswith(b"PLANARIA_NODE_ID=")
                ),
                "?",
            )
            found[node_id] = pid
    return found


def _timeline(tmp_path: Path) -> list[dict[str, Any]]:
    found = list(tmp_path.glob("planaria-runs/*/events.jsonl"))
    if not found:
        return []
    lines = found[0].read_text().splitlines()
    return [json.loads(line) for line in lines if line.endswith("}")]


def test_a_killed_persister_is_restarted_and_the_last_step_is_committed(
    tmp_path: Path, mark: str
) -> None:
    config = job(tmp_path, checkpoint={"keep_last": 2})
    env = {
        **os.environ,
        MARK: mark,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "COLUMNS": "200",
    }
    planaria = str(Path(sys.executable).parent / "planaria")
    proc = subprocess.Popen(
        [planaria, "run", str(config), "--set", _train(400)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    killed: list[str] = []
    try:
        deadline = time.monotonic() + 180
        # Kill first the persister of the node without rank 0, then (once the first is back
        # and another step committed) the one of rank 0's node, which commits every step.
        while len(killed) < 2 and time.monotonic() < deadline and proc.poll() is None:
            timeline = _timeline(tmp_path)
            rounds = [e for e in timeline if e["kind"] == "rendezvous_completed"]
            commits = [e for e in timeline if e["kind"] == "checkpoint_committed"]
            if rounds and commits:
                ranks = rounds[-1]["data"]["ranks"]
                order = sorted(ranks, key=lambda n: -ranks[n])  # node rank 1 first
                target = order[len(killed)]
                running = _persisters(mark)
                restarts = [e for e in timeline if e["kind"] == "persister_restarted"]
                # The previous victim is back, and a step committed since.
                back = len(restarts) == len(killed) and (
                    not restarts or commits[-1]["time"] > restarts[-1]["time"]
                )
                if target in running and back:
                    os.kill(running[target], signal.SIGKILL)
                    killed.append(target)
            time.sleep(0.02)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert len(killed) == 2, out
    assert proc.returncode == 0, out
    timeline = events(tmp_path)
    restarts = [e for e in timeline if e["kind"] == "persister_restarted"]
    assert [e["node"] for e in restarts] == killed, out
    assert all("SIGKILL" in e["data"]["error"] for e in restarts)
    assert not [e for e in timeline if e["kind"] in ("fault_detected", "workers_restarted")], out
    (root,) = tmp_path.glob("planaria-runs/*/checkpoints")
    steps = store_at(root).committed_steps()
    assert steps == [399, 395], sorted(os.listdir(root))  # keep_last: 2
    assert partials(root) == []
    assert json.loads((root / "latest").read_text()) == {"step": 399}


def _corrupt_every_step(root: Path) -> list[int]:
    steps = store_at(root).committed_steps()
    for step in steps:
        flip(root / f"step-{step}" / "rank-1.bin")
    return steps


def test_corrupt_checkpoints_are_in_the_timeline_and_require_restore_stops_the_job(
    tmp_path: Path, mark: str
) -> None:
    storage = tmp_path / "shared-ckpt"
    one_node = {"nodes": 1, "procs_per_node": 2}
    section = {"keep_last": 2, "storage": {"backend": "local", "options": {"path": str(storage)}}}
    first = tmp_path / "first"
    first.mkdir()
    result = run(
        first, mark, str(job(first, job=one_node, checkpoint=section)), "--set", _train(24)
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert _corrupt_every_step(storage) == [23, 19]

    # Every committed step is corrupt: the job starts from scratch, and says so.
    second = tmp_path / "second"
    second.mkdir()
    result = run(
        second, mark, str(job(second, job=one_node, checkpoint=section)), "--set", _train(24)
    )
    assert result.returncode == 0, result.stdout + result.stderr
    timeline = events(second)
    skipped = [e for e in timeline if e["kind"] == "checkpoint_skipped"]
    assert sorted(e["step"] for e in skipped) == [19, 23], timeline
    assert all("rank-1.bin: checksum" in e["data"]["error"] for e in skipped)
    (scratch,) = [e for e in timeline if e["kind"] == "started_from_scratch"]
    assert scratch["data"]["steps"] == [23, 19] and not scratch["data"]["required"]
    text = " ".join(result.stdout.split())
    assert "started from scratch" in text and "skipped checkpoints" in text, result.stdout
    # The new run's steps replaced the corrupt ones; none was deleted for their sake.
    assert store_at(storage).committed_steps() == [23, 19]
    restored, caught = load_quietly(storage)
    assert restored is not None and restored[0] == 23 and not caught

    # With checkpoint.require_restore, nothing restorable stops the job with the reason.
    _corrupt_every_step(storage)
    third = tmp_path / "third"
    third.mkdir()
    strict = {**section, "require_restore": True}
    result = run(third, mark, str(job(third, job=one_node, checkpoint=strict)), "--set", _train(24))
    assert result.returncode == 1, result.stdout + result.stderr
    text = " ".join(result.stdout.split())
    assert "checkpoint.require_restore" in text and "23, 19" in text, result.stdout
    timeline = events(third)
    assert not [e for e in timeline if e["kind"] == "workers_restarted"], timeline
    (stopped,) = [e for e in timeline if e["kind"] == "job_stopped"]
    assert stopped["data"]["cause"] == "checkpoint"
    assert store_at(storage).committed_steps() == [23, 19]  # untouched


def test_a_full_disk_ends_the_run_with_its_last_persisted_step_and_no_restart(
    tmp_path: Path, small_disk: Path, mark: str
) -> None:
    one_node = {"nodes": 1, "procs_per_node": 2}
    for name, allow in (("strict", False), ("allowed", True)):
        where = tmp_path / name
        where.mkdir()
        storage = small_disk / name
        checkpoint = {
            "keep_last": 2,
            "storage": {"backend": "local", "options": {"path": str(storage)}},
            "allow_unpersisted_end": allow,
        }
        config = job(where, job=one_node, checkpoint=checkpoint)
        result = run(where, mark, str(config), "--set", _train(24))
        text = " ".join(result.stdout.split())
        assert result.returncode == (0 if allow else 1), result.stdout + result.stderr
        assert "last persisted step 3 of 23" in text, result.stdout
        timeline = events(where)
        assert not [e for e in timeline if e["kind"] == "workers_restarted"], timeline
        failed = [e for e in timeline if e["kind"] == "checkpoint_failed"]
        assert failed and all("No space left on device" in e["data"]["error"] for e in failed)
        assert store_at(storage).committed_steps() == [3]
        assert partials(storage) == []
        subprocess.run(["rm", "-rf", str(storage)], check=True)
