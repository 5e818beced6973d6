"""The job harness of planaria's end-to-end tests: write a job file, run ``planaria`` as a user
does (also with rank 0 paused mid-training, for a fault to land on), read the job's timeline
and its final weights, wait for something to happen, and make sure that no process of a job
outlives its test. The core's tests, the Slurm, Ray and Kubernetes plugins' job tests and the
benchmarks share it; a third-party scheduler's tests can too.

Every job a test starts through :func:`run` or :func:`start` carries a mark in its environment
(``PLANARIA_TEST_MARK``), which its agents, warm interpreters, workers and their children all
inherit (:mod:`planaria.testing.processes` finds them by it): the :func:`mark` fixture (load
this module with ``pytest_plugins``) fails the test when a process carrying its mark is still
alive after it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

# Named here too: the tests import the whole harness from this module.
from planaria.testing.processes import MARK as MARK
from planaria.testing.processes import marked_processes as marked_processes
from planaria.testing.processes import wait_gone as wait_gone

T = TypeVar("T")

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "train_gpt.py"
"""``examples/train_gpt.py`` of the checkout these helpers run from: the training every
end-to-end test runs (deterministic, so that a run with faults can be compared bit for bit
with a clean one)."""


@pytest.fixture
def mark() -> Iterator[str]:
    """A fresh mark for the test's jobs; after the test, none of their processes may be alive
    (5 s of grace for their exits to land)."""
    value = uuid.uuid4().hex
    yield value
    left = wait_gone(value, grace=5)
    assert left == [], f"processes of the job survived it: {left}"


def job(tmp_path: Path, **sections: object) -> Path:
    """``tmp_path/job.yaml``: :data:`EXAMPLE` for 24 steps, a checkpoint every 4, on 2 local
    nodes of 2 workers, 3 restarts, fast joins and heartbeats, no health checks. Each keyword
    is a section of the file: a mapping is merged into the default one, anything else
    replaces it."""
    config: dict[str, Any] = {
        "job": {
            "name": "e2e",
            "command": [sys.executable, str(EXAMPLE), "--steps", "24", "--ckpt-every", "4"],
            "nodes": 2,
            "procs_per_node": 2,
            "max_restarts": 3,
        },
        "rendezvous": {"join_grace": "2s", "join_timeout": "60s"},
        "master": {"heartbeat_interval": "1s", "heartbeat_timeout": "15s"},
        "diagnosis": {"checks": []},
    }
    _merge(config, sections)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _merge(config: dict[str, Any], sections: Mapping[str, object]) -> None:
    for name, value in sections.items():
        if isinstance(value, dict) and isinstance(config.get(name), dict):
            config[name] = {**config[name], **value}
        else:
            config[name] = value


def with_sections(path: Path, **sections: object) -> Path:
    """The job file at ``path`` with ``sections`` merged in as :func:`job` does (a mapping
    into the section there, anything else in its place): ``rendezvous={"backend":
    "topology"}`` on a file :func:`write_job` wrote."""
    config = yaml.safe_load(path.read_text())
    _merge(config, sections)
    path.write_text(yaml.safe_dump(config))
    return path


def planaria_command(mark: str, args: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """The argv and environment of ``planaria run ARGS`` marked with ``mark`` (wide output,
    this interpreter's console script first on ``PATH``)."""
    env = {
        **os.environ,
        MARK: mark,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "COLUMNS": "200",
    }
    return [str(Path(sys.executable).parent / "planaria"), "run", *args], env


def run(
    tmp_path: Path, mark: str, *args: str, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    """``planaria run ARGS`` in ``tmp_path`` to its end, its output captured."""
    argv, env = planaria_command(mark, args)
    return subprocess.run(
        argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout
    )


def start(tmp_path: Path, mark: str, *args: str) -> subprocess.Popen[str]:
    """``planaria run`` in the background (stdout and stderr together), for faults from outside."""
    argv, env = planaria_command(mark, args)
    return subprocess.Popen(
        argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def events(tmp_path: Path) -> list[dict[str, Any]]:
    """The events of the one run under ``tmp_path`` (:func:`job_events` takes every run's)."""
    (timeline,) = tmp_path.glob("planaria-runs/*/events.jsonl")
    return [json.loads(line) for line in timeline.read_text().splitlines()]


def weights(path: Path) -> dict[str, Any]:
    """The tensors saved at ``path`` by ``torch.save`` (needs torch)."""
    import torch

    loaded: dict[str, Any] = torch.load(path, weights_only=True, map_location="cpu")
    return loaded


def bind_every_interface(path: Path) -> Path:
    """Have the job file's master listen on every interface (``master.host: 0.0.0.0``, no
    ``master.advertise``): for nodes that are hosts of their own, which reach it at the address
    the master finds towards them (:mod:`planaria.master.advertise`)."""
    config = yaml.safe_load(path.read_text())
    config.setdefault("master", {})["host"] = "0.0.0.0"
    path.write_text(yaml.safe_dump(config))
    return path


def run_planaria(
    where: Path, *args: str, timeout: float = 600, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m planaria ARGS`` in ``where``, its output captured (wide, for tables)."""
    return subprocess.run(
        [sys.executable, "-m", "planaria", *args],
        cwd=where,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def write_job(
    where: Path,
    name: str,
    command: Sequence[str],
    scheduler: Mapping[str, Any] | None = None,
    /,
    **job: object,
) -> Path:
    """``where/job.yaml``: a job of 2 nodes of 1 worker running ``command``, 3 restarts, fast
    joins and heartbeats, no health checks; ``job`` overrides the ``job`` section (its
    ``command`` too) and ``scheduler`` is the ``scheduler`` section (none: the local one)."""
    config: dict[str, object] = {
        "job": {
            "name": name,
            "command": list(command),
            "nodes": 2,
            "procs_per_node": 1,
            "max_restarts": 3,
            **job,
        },
        "rendezvous": {"join_grace": "2s", "join_timeout": "90s"},
        "master": {"heartbeat_interval": "1s", "heartbeat_timeout": "15s"},
        "diagnosis": {"checks": [], "preflight": False},
    }
    if scheduler is not None:
        config["scheduler"] = dict(scheduler)
    path = where / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@contextlib.contextmanager
def paused_run(where: Path, config: Path, at_step: int = 10) -> Iterator[subprocess.Popen[str]]:
    """``planaria run`` of ``config`` in ``where``, rank 0 stopping itself (SIGSTOP, chaos
    ``stop_worker``) at ``at_step`` of the first attempt, so that a fault from outside lands
    mid-training; entered once it did. Its output is one pipe (stdout and stderr). At the end
    a run still going is interrupted."""
    chaos = ["--set", f'chaos=[{{"kind": "stop_worker", "rank": 0, "at_step": {at_step}}}]']
    run = subprocess.Popen(
        [sys.executable, "-m", "planaria", "run", str(config), *chaos],
        cwd=where,
        env={**os.environ, "COLUMNS": "200"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:

        def paused() -> bool:
            logs = where.glob("planaria-runs/*/logs/*.log")
            return any("stop_worker" in p.read_text() for p in logs)

        wait_for(f"rank 0 pausing at step {at_step}", paused)
        yield run
    finally:
        if run.poll() is None:
            run.send_signal(signal.SIGINT)
            run.communicate(timeout=60)


def job_events(where: Path) -> list[dict[str, Any]]:
    """Every event of every run under ``where`` (their ``events.jsonl``)."""
    found: list[dict[str, Any]] = []
    for timeline in where.glob("planaria-runs/*/events.jsonl"):
        found += [json.loads(line) for line in timeline.read_text().splitlines()]
    return found


def final_weights(where: Path) -> dict[str, Any]:
    """The ``final.pt`` that ``examples/train_gpt.py`` saved in ``where`` (needs torch)."""
    (path,) = where.glob("final.pt")
    return weights(path)


def standby_took_over(timeline: Sequence[dict[str, Any]], lost: str, spare: str) -> dict[str, Any]:
    """Check, in a job's events, that ``lost`` was the one node lost and that ``spare``, a node
    standing by (``job.standby``), took its node rank in the round after; and that the
    scheduler's replacement of ``lost`` joined no round (it refilled the pool). Returns the
    ``node_replaced`` event."""
    lost_events = [
        e
        for e in timeline
        if e["kind"] == "fault_detected" and e["data"].get("fault") == "node_lost"
    ]
    assert {e["node"] for e in lost_events} == {lost}, lost_events
    rounds = [e for e in timeline if e["kind"] == "rendezvous_completed"]
    before = next(r for r in reversed(rounds) if lost in r["data"]["ranks"])
    after = rounds[-1]
    assert after["data"].get("from_standby") == [spare], after["message"]
    assert after["data"]["ranks"][spare] == before["data"]["ranks"][lost], after
    assert f"{spare} from standby" in after["message"]
    (replaced,) = [e for e in timeline if e["kind"] == "node_replaced"]
    refill = replaced["data"]["replacement"]
    assert all(refill not in r["data"]["ranks"] for r in rounds), rounds
    return replaced


def switches_by_rank(
    timeline: Sequence[dict[str, Any]], switch_of: Callable[[str], str]
) -> list[str]:
    """Check, in a job's events, that its first round (``rendezvous_completed``) gave node
    ranks 0 to n-1 and the nodes of each switch contiguous ones (``rendezvous.backend:
    topology``); ``switch_of`` names a node's switch (from the cluster's side, not the job's).
    Returns the switch of each rank, in rank order (``["s1", "s1", "s2"]``)."""
    first = next(e for e in timeline if e["kind"] == "rendezvous_completed")
    ranks: dict[str, int] = first["data"]["ranks"]
    assert sorted(ranks.values()) == list(range(len(ranks))), ranks
    switches = [switch_of(node) for node in sorted(ranks, key=ranks.__getitem__)]
    seen: list[str] = []
    for switch in switches:
        if seen and seen[-1] == switch:
            continue
        assert switch not in seen, f"the ranks of switch {switch} are split: {switches} {ranks}"
        seen.append(switch)
    return switches


def restored_from_replicas(timeline: Sequence[dict[str, Any]], lost: str) -> int:
    """Check, in a job's events, that the round after ``lost`` was lost restored every rank
    from memory, ``lost``'s ranks from the replicas a survivor kept (``checkpoint.replica``).
    Returns the step restored."""
    rounds = [e for e in timeline if e["kind"] == "rendezvous_completed"]
    before = next(r for r in reversed(rounds) if lost in r["data"]["ranks"])
    after = rounds[-1]
    restore, why = after["data"]["restore"], after["data"]["restore_why"]
    assert restore.startswith("memory:"), after["message"]
    procs = before["data"]["world_size"] // len(before["data"]["ranks"])
    first = before["data"]["ranks"][lost] * procs
    fetched = {int(rank) for rank in re.findall(r"rank (\d+) from [^,:]+", why)}
    assert why.endswith(": replicas)") and fetched == set(range(first, first + procs)), why
    survivors = set(after["data"]["ranks"]) - {lost}
    assert all(holder in survivors for holder in re.findall(r"rank \d+ from ([^,:]+)", why)), why
    return int(restore.partition(":")[2])


def wait_for(
    what: str, predicate: Callable[[], T], timeout: float = 120.0, every: float = 0.2
) -> T:
    """The first true value of ``predicate()``; the test fails naming ``what`` after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen within {timeout:g}s")
        time.sleep(every)
