"""``GET /metrics`` of a real job: ``planaria run`` of the example's DDP training with a worker
killed on purpose, scraped the way Prometheus scrapes it while the job runs. The counters move
as the job's events say (no restart, then one with the fault's cause), the exposition is valid
text format (promtool's check where Debian's ``prometheus`` is installed, prometheus_client's
parser always), and the route needs the token unless ``master.metrics_public`` is true."""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest
from prometheus_client.parser import text_string_to_metric_families

from planaria import events
from planaria.master.job import Master
from planaria.master.metrics import JobMetrics
from planaria.master.state import Node, NodePhase
from planaria.scheduler.local import LocalOptions, LocalScheduler
from planaria.testing.jobs import EXAMPLE, job, start, wait_gone
from support.grafana_dashboard import SERIES, asked, dashboard, served
from support.master import settings

pytest.importorskip("torch")

KILL_AT = 30
STEPS = 80
Labels = frozenset[tuple[str, str]]


@dataclass(frozen=True)
class Scrape:
    at: float
    text: str
    values: dict[tuple[str, Labels], float]

    def get(self, name: str, **labels: str) -> float | None:
        return self.values.get((name, frozenset(labels.items())))

    def total(self, name: str, **labels: str) -> float:
        """The sum of ``name`` over the series whose labels include ``labels``."""
        wanted = set(labels.items())
        return sum(v for (n, ls), v in self.values.items() if n == name and wanted <= ls)


def parse(text: str) -> dict[tuple[str, Labels], float]:
    """Every sample, by name and labels; prometheus_client's parser raises on bad text."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def get(url: str, token: str | None = None) -> tuple[int, str, str]:
    """(status, content type, body) of a GET."""
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
            return r.status, r.headers["Content-Type"], r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read().decode()


def master_of(workdir: Path, proc: subprocess.Popen[str]) -> tuple[str, str]:
    """The running job's master URL and token, from its run directory, once it listens."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        for db in workdir.glob("planaria-runs/*/master.db"):
            connection = sqlite3.connect(db)
            try:
                row = connection.execute("SELECT value FROM meta WHERE key = 'server'").fetchone()
            except sqlite3.OperationalError:
                row = None
            finally:
                connection.close()
            if row is not None:
                port = json.loads(row[0])["port"]
                return f"http://127.0.0.1:{port}", (db.parent / "token").read_text().strip()
        time.sleep(0.1)
    raise AssertionError("the master never listened")


def finish(proc: subprocess.Popen[str], mark: str) -> str:
    """Wait for the run to end (killing it if it does not) and for its processes to go."""
    try:
        out, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"the run did not end:\n{out[-3000:]}") from None
    left = wait_gone(mark, grace=10)
    assert left == [], f"processes of the job survived it: {left}"
    return out


@dataclass(frozen=True)
class Run:
    scrapes: list[Scrape]
    refused: list[tuple[int, str]]
    """``/metrics`` without the token, then with a wrong one: (status, body)."""
    output: str
    returncode: int
    timeline: list[dict[str, object]]


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    """The example's training on 2 nodes x 2 ranks, rank 1 SIGKILLed after step KILL_AT,
    scraped every 0.1 s from its master's start to its end."""
    workdir = tmp_path_factory.mktemp("metrics")
    command = [sys.executable, str(EXAMPLE), "--steps", str(STEPS), "--ckpt-every", "4"]
    config = job(
        workdir,
        job={"command": command},
        master={"heartbeat_interval": "0.5s"},
        chaos=[{"kind": "kill_worker", "rank": 1, "at_step": KILL_AT}],
    )
    mark = uuid.uuid4().hex
    proc = start(workdir, mark, str(config))
    scrapes: list[Scrape] = []
    try:
        url, token = master_of(workdir, proc)
        refused = [get(f"{url}/metrics")[::2], get(f"{url}/metrics", "wrong")[::2]]
        while proc.poll() is None:
            try:
                status, content_type, text = get(f"{url}/metrics", token)
            except OSError:  # the master stopped serving: the job is over
                break
            assert status == 200, text
            assert content_type == "text/plain; version=0.0.4; charset=utf-8"
            scrapes.append(Scrape(time.monotonic(), text, parse(text)))
            time.sleep(0.1)
    finally:
        output = finish(proc, mark)
    (timeline,) = workdir.glob("planaria-runs/*/events.jsonl")
    recorded = [json.loads(line) for line in timeline.read_text().splitlines()]
    yield Run(scrapes, refused, output, proc.returncode, recorded)


def test_the_counters_move_as_the_job_goes_through_a_worker_kill(faulty_run: Run) -> None:
    run = faulty_run
    assert run.returncode == 0, run.output[-3000:]
    scrapes = run.scrapes
    assert len(scrapes) > 10, "too few scrapes while the job ran"

    # Before the fault: training, no restart, no fault.
    training = [
        s for s in scrapes if s.get("planaria_job_state", state="running") == 1
        and (s.get("planaria_step") or -1) >= 1
    ]  # fmt: skip
    assert training, "no scrape saw the job training"
    before = training[0]
    assert before.total("planaria_restarts_total") == 0
    assert before.total("planaria_faults_total") == 0
    assert before.get("planaria_restarts_total", cause="worker_failed") == 0  # there from the start
    assert before.get("planaria_nodes", state="running") == 2
    assert before.get("planaria_world_nodes") == 2
    assert before.get("planaria_round") == 1
    # The round's ready went out as a burst of join replies; no action was pushed yet.
    assert (before.get("planaria_channel_last_push_seconds", op="/rendezvous/join") or 0) > 0
    assert before.get("planaria_channel_last_push_seconds", op="/actions") is None
    step_before = before.get("planaria_step")
    assert step_before is not None and 1 <= step_before < STEPS

    # After the recovery: one restart, caused by the failed worker; the kill counted once as
    # a worker fault of its class; its recovery in the histogram; training on past the fault.
    recovered = [s for s in scrapes if (s.get("planaria_recovery_seconds_count") or 0) >= 1]
    assert recovered, "no scrape saw the recovery"
    after = recovered[-1]
    assert after.get("planaria_restarts_total", cause="worker_failed") == 1
    assert after.total("planaria_restarts_total") == 1
    (fault,) = [
        e for e in run.timeline
        if e["kind"] == "fault_detected" and e["data"]["fault"] == "worker_failed"  # type: ignore[index]
        and not e["data"].get("secondary")  # type: ignore[attr-defined]
    ]  # fmt: skip
    fault_class = fault["data"]["fault_class"]  # type: ignore[index]
    assert after.get("planaria_faults_total", fault="worker_failed", **{"class": fault_class}) == 1
    assert after.total("planaria_faults_total") == 1
    # A rule at a step fires inside the worker, unannounced (only kill_node is announced).
    chaos = [e for e in run.timeline if e["data"].get("fault") == "chaos"]  # type: ignore[attr-defined]
    assert after.total("planaria_faults_injected_total") == len(chaos)
    (recovery,) = [e for e in run.timeline if e["kind"] == "recovered"]
    assert after.get("planaria_recovery_seconds_sum") == pytest.approx(
        recovery["data"]["recovery_s"]  # type: ignore[index]
    )
    lost = recovery["data"].get("steps_lost") or 0  # type: ignore[attr-defined]
    assert after.get("planaria_steps_lost_total") == lost
    assert after.get("planaria_round") == 2
    assert after.get("planaria_events_total", kind="workers_restarted") == 1
    assert (after.get("planaria_channel_last_push_seconds", op="/actions") or 0) > 0, "the restart"
    last = max(s.get("planaria_step") or -1 for s in recovered)
    assert last > max(step_before, KILL_AT), "the step did not advance past the fault"
    assert after.get("planaria_node_replacements_total", outcome="replaced") == 0

    # Checkpoints: committed steps counted with their bytes and persist times.
    committed = after.get("planaria_checkpoints_committed_total") or 0
    assert committed >= 1
    assert after.get("planaria_checkpoint_persist_seconds_count") == committed
    assert (after.get("planaria_checkpoint_committed_bytes_total") or 0) > 0
    assert (after.get("planaria_checkpoint_last_committed_step") or -1) >= 4

    # Goodput: known once a step was done, a ratio, and the downtime is the recovery's.
    assert 0 < (after.get("planaria_goodput_ratio") or 0) <= 1
    assert after.get("planaria_downtime_seconds") == pytest.approx(
        recovery["data"]["recovery_s"]  # type: ignore[index]
    )
    assert after.get("planaria_startup_seconds") is not None
    # Per node: step times once the straggler window is full, and no straggler.
    stepping = [s for s in scrapes if s.total("planaria_node_step_seconds") > 0]
    assert stepping, "no scrape had the nodes' step times"
    nodes = {dict(ls)["node"] for n, ls in stepping[-1].values if n == "planaria_node_step_seconds"}
    assert nodes == {"node-0", "node-1"}
    assert after.total("planaria_node_straggler") == 0
    assert after.get("planaria_job_info", job="e2e", run_id=_run_id(run)) == 1

    # Tokens: the example reports each step's (8 sequences x 32 tokens x 4 ranks), rank 0's
    # count. The counter grows by whole steps, never past the steps done in the first round,
    # and on through the restart (the steps done again count again).
    step_tokens = 8 * 32 * 4
    counted = [
        (s.get("planaria_round"), s.get("planaria_step") or 0, s.get("planaria_tokens_total"))
        for s in scrapes
    ]
    totals = [t for _, _, t in counted if t is not None]
    assert totals and all(t % step_tokens == 0 for t in totals)
    first_round = [t for r, step, t in counted if r == 1 and t is not None]
    assert first_round and all(
        t <= (step + 1) * step_tokens for r, step, t in counted if r == 1 and t is not None
    )
    assert totals[-1] > max(first_round)
    # The timeline's samples carry the count (never going down), and this round's part of it.
    counts = [
        cast(dict[str, Any], e["data"])
        for e in run.timeline
        if e["kind"] == "progress" and cast(dict[str, Any], e["data"]).get("tokens") is not None
    ]
    ordered = [d["tokens"] for d in counts]
    assert ordered and ordered == sorted(ordered)
    for round_ in {d["round"] for d in counts}:
        before = {d["tokens"] - d["round_tokens"] for d in counts if d["round"] == round_}
        assert len(before) == 1, (round_, before)  # what the earlier rounds counted

    # Counters never go down between scrapes.
    for name in (
        "planaria_restarts_total",
        "planaria_events_total",
        "planaria_faults_total",
        "planaria_tokens_total",
    ):
        totals = [s.total(name) for s in scrapes]
        assert totals == sorted(totals), name


def _run_id(run: Run) -> str:
    (started,) = [e for e in run.timeline if e["kind"] == "job_started"]
    return str(started["data"]["run_id"])  # type: ignore[index]


def test_metrics_need_the_token_by_default(faulty_run: Run) -> None:
    for status, body in faulty_run.refused:
        assert status == 401
        assert "token" in json.loads(body)["error"]


def test_promtool_accepts_every_scrape(faulty_run: Run) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip(
            "promtool is not installed (Debian package prometheus): the exposition was "
            "checked with prometheus_client's parser only"
        )
    for scrape in faulty_run.scrapes[:: max(1, len(faulty_run.scrapes) // 8)]:
        checked = subprocess.run(
            [promtool, "check", "metrics"], input=scrape.text, capture_output=True, text=True
        )
        assert checked.returncode == 0, checked.stdout + checked.stderr
        assert checked.stdout.strip() == "" and checked.stderr.strip() == ""


SLEEPER = "import time; time.sleep(3)"


def test_metrics_public_serves_them_without_the_token_and_nothing_else(tmp_path: Path) -> None:
    config = job(
        tmp_path,
        job={"command": [sys.executable, "-c", SLEEPER], "nodes": 1, "procs_per_node": 1},
        master={"metrics_public": True},
    )
    mark = uuid.uuid4().hex
    proc = start(tmp_path, mark, str(config))
    try:
        url, token = master_of(tmp_path, proc)
        status, content_type, text = get(f"{url}/metrics")
        assert status == 200, text
        assert content_type.startswith("text/plain; version=0.0.4")
        values = Scrape(0.0, text, parse(text))
        assert values.total("planaria_job_info", job="e2e") == 1
        assert get(f"{url}/v1/status")[0] == 401  # the rest of the API still needs it
        assert get(f"{url}/v1/status", token)[0] == 200
    finally:
        output = finish(proc, mark)
    assert proc.returncode == 0, output[-3000:]


def test_a_node_id_of_any_characters_comes_back_as_it_is(tmp_path: Path) -> None:
    """Node ids are the scheduler's: quotes, backslashes and newlines are escaped, and every
    per-node family parses back to the same ids, in promtool too where it is installed."""
    master = Master(settings(tmp_path), LocalScheduler(LocalOptions()), tmp_path)
    try:
        odd = ['a"b', "c\\d", "e\nf", "g h=i,j}"]
        for node_id in odd:
            master.fleet.add(Node(node_id, "host", NodePhase.RUNNING))
        master.diagnosis.detector.flagged.add(('a"b', 0))
        text = JobMetrics(master).exposition().root
    finally:
        master.timeline.close()
    scrape = Scrape(0.0, text, parse(text))
    flags = {
        dict(ls)["node"]: v
        for (n, ls), v in scrape.values.items()
        if n == "planaria_node_straggler"
    }
    assert flags == {'a"b': 1, "c\\d": 0, "e\nf": 0, "g h=i,j}": 0}
    assert scrape.get("planaria_nodes", state="running") == 4
    promtool = shutil.which("promtool")
    if promtool is not None:
        checked = subprocess.run(
            [promtool, "check", "metrics"], input=text, capture_output=True, text=True
        )
        assert checked.returncode == 0, checked.stdout + checked.stderr


def test_events_before_the_metrics_were_made_are_counted_too(tmp_path: Path) -> None:
    """Events a master emits before its API (and its metrics) exist are counted too."""
    master = Master(settings(tmp_path), LocalScheduler(LocalOptions()), tmp_path)
    try:
        restart = events.WorkersRestarted(round=2, cause="fault", fault="hang", restart=1)
        master.emit(restart, "before")
        metrics = JobMetrics(master)
        master.emit(restart, "after")
        master.emit(events.WorkersRestarted(round=3, cause="scale_up", standby=["n"]), "grow")
        scrape = Scrape(0.0, "", parse(metrics.exposition().root))
    finally:
        master.timeline.close()
    assert scrape.get("planaria_restarts_total", cause="hang") == 2
    assert scrape.get("planaria_restarts_total", cause="scale_up") == 1
    assert scrape.get("planaria_events_total", kind="workers_restarted") == 3


def test_the_grafana_dashboard_asks_only_for_what_the_master_serves(faulty_run: Run) -> None:
    """Every metric a query of ``docs/grafana.json`` names is served by the real job's master,
    and the dashboard shows what a user asks of a job: its goodput, faults, recovery..."""
    served_names: set[str] = set()
    for scrape in faulty_run.scrapes:
        served_names |= served(scrape.text)
    asked_names = asked(dashboard())
    unknown = {name: where for name, where in asked_names.items() if name not in served_names}
    assert unknown == {}, f"the dashboard asks for metrics no master serves: {unknown}"
    assert {
        "planaria_step",
        "planaria_goodput_ratio",
        "planaria_restarts_total",
        "planaria_faults_total",
        "planaria_recovery_seconds_bucket",
        "planaria_steps_lost_total",
        "planaria_checkpoints_committed_total",
        "planaria_nodes",
        "planaria_node_step_seconds",
        "planaria_tokens_total",
    } <= set(asked_names)
    # Every family the master serves is on the dashboard.
    missing = [
        family.name
        for family in text_string_to_metric_families(faulty_run.scrapes[-1].text)
        if not {family.name + suffix for suffix in SERIES.get(family.type, ("",))}
        & set(asked_names)
    ]
    assert missing == [], f"metrics the dashboard does not show: {missing}"
