"""The built-in ``local`` scheduler, with real processes standing in for agents.

Every agent writes its pid to ``$PIDDIR/<node id>.pid`` (and its helpers theirs to
``$PIDDIR/<node id>.<name>.pid``), so that after each test the fixture can check that no process
the test made is left, zombies counting as gone.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest
from pydantic import ValidationError

from planaria.errors import SchedulerError
from planaria.plugin.manager import PluginManager
from planaria.plugin.records import PluginKind
from planaria.process import running
from planaria.scheduler.api import LaunchSpec, NodeEvent, NodeState
from planaria.scheduler.local import LocalOptions, LocalScheduler
from support.scheduler import PRELUDE, Harness, wait_for

SLEEP = "time.sleep(60)"


def collect(
    scheduler: LocalScheduler, done: Callable[[list[NodeEvent]], bool], timeout: float = 5.0
) -> list[NodeEvent]:
    events: list[NodeEvent] = []
    deadline = time.monotonic() + timeout
    while not done(events):
        assert time.monotonic() < deadline, f"timed out; events so far: {events}"
        events += scheduler.poll(0.05)
    return events


def by_node(events: list[NodeEvent]) -> dict[str, list[tuple[NodeState, str]]]:
    out: dict[str, list[tuple[NodeState, str]]] = {}
    for event in events:
        out.setdefault(event.node_id, []).append((event.state, event.reason))
    return out


TERMINAL = {NodeState.SUCCEEDED, NodeState.FAILED, NodeState.LOST}


def drain_running(scheduler: LocalScheduler, count: int) -> None:
    events = collect(scheduler, lambda e: len(e) >= count)
    assert [e.state for e in events] == [NodeState.RUNNING] * count


# -- launch and poll ----------------------------------------------------------------------


def test_launch_then_running_succeeded_failed_and_lost(harness: Harness) -> None:
    scheduler = harness.scheduler()
    spec = harness.spec(
        """
        if node == "node-0": sys.exit(0)
        if node == "node-1": sys.exit(2)
        time.sleep(60)
        """
    )
    handles = scheduler.launch(spec, 3)
    assert [h.node_id for h in handles] == ["node-0", "node-1", "node-2"]
    assert [h.host for h in handles] == ["local-0", "local-1", "local-2"]
    assert all(h.state is NodeState.PENDING for h in handles)

    first = scheduler.poll(0.0)
    assert [(e.node_id, e.state) for e in first[:3]] == [
        (f"node-{i}", NodeState.RUNNING) for i in range(3)
    ]
    events = first + collect(
        scheduler,
        lambda e: {x.node_id for x in first + e if x.state in TERMINAL} >= {"node-0", "node-1"},
    )
    seen = by_node(events)
    assert seen["node-0"] == [(NodeState.RUNNING, ""), (NodeState.SUCCEEDED, "")]
    assert seen["node-1"] == [(NodeState.RUNNING, ""), (NodeState.FAILED, "exit code 2")]
    assert seen["node-2"] == [(NodeState.RUNNING, "")]

    os.kill(harness.pid("node-2"), signal.SIGKILL)
    killed = time.monotonic()
    lost = collect(scheduler, lambda e: bool(e), timeout=10.0)
    assert time.monotonic() - killed < 10.0 / 2  # seen through the pidfd, not at the timeout
    assert lost == [NodeEvent(node_id="node-2", state=NodeState.LOST, reason="killed by SIGKILL")]
    assert scheduler.poll(0.0) == []


def test_environment_holds_node_id_host_spec_env_and_ours(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PLANARIA_TEST_INHERITED", "from-parent")
    monkeypatch.setenv("PLANARIA_TEST_OVERRIDDEN", "from-parent")
    out = harness.tmp / "env"
    out.mkdir()
    scheduler = harness.scheduler(hosts=2)
    spec = harness.spec(
        """
        import json
        keys = ["PLANARIA_NODE_ID", "PLANARIA_HOST", "PLANARIA_TEST_INHERITED",
                "PLANARIA_TEST_OVERRIDDEN", "FROM_SPEC"]
        values = {k: os.environ.get(k) for k in keys}
        pathlib.Path(os.environ["OUT"], node).write_text(json.dumps(values))
        """,
        env={"OUT": str(out), "FROM_SPEC": "x y", "PLANARIA_TEST_OVERRIDDEN": "from-spec"},
    )
    handles = scheduler.launch(spec, 3)
    assert [h.host for h in handles] == ["local-0", "local-1", "local-0"]
    collect(scheduler, lambda e: sum(x.state is NodeState.SUCCEEDED for x in e) == 3)
    for handle in handles:
        assert json.loads((out / handle.node_id).read_text()) == {
            "PLANARIA_NODE_ID": handle.node_id,
            "PLANARIA_HOST": handle.host,
            "PLANARIA_TEST_INHERITED": "from-parent",
            "PLANARIA_TEST_OVERRIDDEN": "from-spec",
            "FROM_SPEC": "x y",
        }


def _plain_wait(timeout: float) -> float:
    """How long a plain ``Event.wait(timeout)`` takes on this machine now: the baseline the
    scheduler's own waits are held to (a loaded machine oversleeps both alike)."""
    started = time.monotonic()
    threading.Event().wait(timeout)
    return time.monotonic() - started


def test_poll_respects_its_timeout_and_wakes_on_an_exit(harness: Harness) -> None:
    scheduler = harness.scheduler()
    baseline = _plain_wait(0.2)
    started = time.monotonic()
    assert scheduler.poll(0.2) == []  # nothing launched
    assert 0.2 <= time.monotonic() - started < max(0.3, 2 * baseline)

    scheduler.launch(harness.spec(SLEEP), 1)
    drain_running(scheduler, 1)
    for timeout in (0.0, 0.25):
        baseline = _plain_wait(timeout)
        started = time.monotonic()
        assert scheduler.poll(timeout) == []
        assert timeout <= time.monotonic() - started < max(timeout + 0.1, 2 * baseline + 0.05)

    scheduler.launch(harness.spec("time.sleep(0.2)"), 1)
    assert [e.state for e in scheduler.poll(0.0)] == [NodeState.RUNNING]
    started = time.monotonic()
    assert scheduler.poll(10.0) == [NodeEvent(node_id="node-1", state=NodeState.SUCCEEDED)]
    assert time.monotonic() - started < 10.0 / 2  # woken by the exit, not by its timeout


def test_what_an_agent_leaves_in_its_group_dies_with_it(harness: Harness) -> None:
    scheduler = harness.scheduler()
    spec = harness.spec(
        """
        import subprocess
        helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        note_pid("helper", helper.pid)
        """
    )
    scheduler.launch(spec, 1)
    events = collect(scheduler, lambda e: any(x.state in TERMINAL for x in e))
    assert events[-1].state is NodeState.SUCCEEDED
    helper = harness.pid("node-0", "helper")
    wait_for(lambda: not running(helper), timeout=1.0)


def test_log_files_get_output_appended_with_mode_0600(harness: Harness) -> None:
    log_dir = harness.tmp / "logs" / "run"
    log_dir.mkdir(parents=True)
    (log_dir / "node-0.log").write_text("earlier\n")
    (log_dir / "node-0.log").chmod(0o644)
    scheduler = harness.scheduler()
    spec = harness.spec(
        'print("out of", node, flush=True); print("err of", node, file=sys.stderr)',
        log_dir=log_dir,
    )
    scheduler.launch(spec, 2)
    collect(scheduler, lambda e: sum(x.state is NodeState.SUCCEEDED for x in e) == 2)
    for node, before in (("node-0", "earlier\n"), ("node-1", "")):
        path = log_dir / f"{node}.log"
        assert path.read_text() == f"{before}out of {node}\nerr of {node}\n"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600

    fresh = harness.tmp / "new" / "dir"  # created on demand
    scheduler.launch(harness.spec("print('hi')", log_dir=fresh), 1)
    collect(scheduler, lambda e: any(x.state is NodeState.SUCCEEDED for x in e))
    assert (fresh / "node-2.log").read_text() == "hi\n"


# -- replace ------------------------------------------------------------------------------


def test_replace_with_exclude_host_moves_to_a_new_host(harness: Harness) -> None:
    scheduler = harness.scheduler(stop_grace="10s")
    scheduler.launch(harness.spec(SLEEP), 2)
    drain_running(scheduler, 2)
    old = harness.pid("node-0")

    started = time.monotonic()
    new = scheduler.replace("node-0", exclude_host=True)
    assert time.monotonic() - started < 10 / 2  # the agent obeys SIGTERM: no wait for the grace
    assert (new.node_id, new.state) == ("node-2", NodeState.PENDING)
    assert new.host not in ("local-0", "local-1")
    assert scheduler.excluded_hosts() == {"local-0"}
    assert not running(old)
    # The replaced node is released: its end is not reported, the new one's start is.
    assert scheduler.poll(0.1) == [NodeEvent(node_id="node-2", state=NodeState.RUNNING)]

    assert scheduler.replace("node-1", exclude_host=True).node_id == "node-3"
    assert scheduler.excluded_hosts() == {"local-0", "local-1"}
    assert scheduler.replace("node-2", exclude_host=False).node_id == "node-4"
    assert scheduler.excluded_hosts() == {"local-0", "local-1"}
    with pytest.raises(SchedulerError, match="already stopped or replaced"):
        scheduler.replace("node-0", exclude_host=True)
    with pytest.raises(SchedulerError, match="unknown node"):
        scheduler.replace("node-99", exclude_host=False)


def test_replace_cycles_over_the_hosts_left(harness: Harness) -> None:
    scheduler = harness.scheduler(hosts=3)
    assert [h.host for h in scheduler.launch(harness.spec(SLEEP), 3)] == [
        "local-0",
        "local-1",
        "local-2",
    ]
    first = scheduler.replace("node-0", exclude_host=True)
    assert first.host in {"local-1", "local-2"}
    second = scheduler.replace(first.node_id, exclude_host=True)
    assert {"local-0", first.host, second.host} == {"local-0", "local-1", "local-2"}
    assert scheduler.excluded_hosts() == {"local-0", first.host}


def test_replace_refused_when_every_host_is_excluded(harness: Harness) -> None:
    scheduler = harness.scheduler(hosts=1)
    scheduler.launch(harness.spec(SLEEP), 1)
    drain_running(scheduler, 1)
    with pytest.raises(SchedulerError, match=r"all 1 local host\(s\) are excluded \(local-0\)"):
        scheduler.replace("node-0", exclude_host=True)
    # Nothing changed: the node still runs, no host is excluded.
    assert running(harness.pid("node-0"))
    assert scheduler.excluded_hosts() == set()
    assert scheduler.poll(0.0) == []
    # A replacement that may land on the same host is fine.
    assert scheduler.replace("node-0", exclude_host=False).host == "local-0"


def test_replace_of_a_node_that_already_ended(harness: Harness) -> None:
    scheduler = harness.scheduler()
    scheduler.launch(harness.spec("sys.exit(3)"), 1)
    events = collect(scheduler, lambda e: any(x.state in TERMINAL for x in e))
    assert events[-1] == NodeEvent(node_id="node-0", state=NodeState.FAILED, reason="exit code 3")
    new = scheduler.replace("node-0", exclude_host=False)
    assert new.node_id == "node-1"
    assert collect(scheduler, lambda e: len(e) >= 2) == [
        NodeEvent(node_id="node-1", state=NodeState.RUNNING),
        NodeEvent(node_id="node-1", state=NodeState.FAILED, reason="exit code 3"),
    ]


# -- stop ---------------------------------------------------------------------------------


def test_stop_kills_what_ignores_sigterm_after_the_grace(harness: Harness) -> None:
    grace = 1.0
    scheduler = harness.scheduler(stop_grace=f"{grace}s")
    spec = harness.spec(
        """
        import signal, subprocess
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # inherited by the helper
        helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        note_pid("helper", helper.pid)
        time.sleep(60)
        """
    )
    scheduler.launch(spec, 2)
    pids = [harness.pid(f"node-{i}") for i in range(2)]
    helpers = [harness.pid(f"node-{i}", "helper") for i in range(2)]

    started = time.monotonic()
    scheduler.stop()
    elapsed = time.monotonic() - started
    assert grace <= elapsed < 2 * grace  # one grace for all the nodes, not one each
    assert not any(running(pid) for pid in pids + helpers)
    assert scheduler.poll(0.0) == []  # stopped nodes are not reported

    started = time.monotonic()
    scheduler.stop()
    scheduler.stop(["node-0", "node-1", "node-0"])
    assert time.monotonic() - started < grace / 2  # nothing left to stop: no grace waited
    with pytest.raises(SchedulerError, match="unknown node 'node-7'"):
        scheduler.stop(["node-7"])


def test_stop_some_nodes_and_do_not_wait_for_the_grace_needlessly(harness: Harness) -> None:
    scheduler = harness.scheduler(stop_grace=10)
    scheduler.launch(harness.spec(SLEEP), 3)
    drain_running(scheduler, 3)
    pids = [harness.pid(f"node-{i}") for i in range(3)]
    started = time.monotonic()
    scheduler.stop(["node-1"])
    assert time.monotonic() - started < 10 / 2  # it obeyed SIGTERM: no wait for the grace
    assert [running(pid) for pid in pids] == [True, False, True]
    os.kill(pids[0], signal.SIGTERM)
    assert scheduler.poll(2.0) == [
        NodeEvent(node_id="node-0", state=NodeState.LOST, reason="killed by SIGTERM")
    ]


# -- the death signal and threads ---------------------------------------------------------

PARENT = """\
import sys, time
from planaria.scheduler.api import LaunchSpec
from planaria.scheduler.local import LocalOptions, LocalScheduler
scheduler = LocalScheduler(LocalOptions())
spec = LaunchSpec(job="t", command=tuple(sys.argv[2:]), env={"PIDDIR": sys.argv[1]})
scheduler.launch(spec, 1)
print("launched", flush=True)
time.sleep(60)
"""


def test_nodes_die_with_the_process_that_started_them(harness: Harness) -> None:
    command = [sys.executable, "-c", PRELUDE + SLEEP]
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(harness.piddir), *command],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert parent.stdout is not None
        while parent.stdout.readline() not in (b"launched\n", b""):
            pass
        node = harness.pid("node-0")
        assert running(node)
        parent.kill()
        parent.wait()
        wait_for(lambda: not running(node), timeout=2.0)
    finally:
        parent.kill()
        parent.wait()
        if parent.stdout is not None:
            parent.stdout.close()


def test_processes_are_started_from_one_thread_only(harness: Harness) -> None:
    scheduler = harness.scheduler()
    scheduler.launch(harness.spec(SLEEP), 1)
    errors: list[BaseException] = []

    def other() -> None:
        try:
            scheduler.replace("node-0", exclude_host=False)
        except SchedulerError as exc:
            errors.append(exc)

    thread = threading.Thread(target=other, name="short-lived")
    thread.start()
    thread.join()
    assert len(errors) == 1
    assert "one long-lived thread" in str(errors[0])
    assert "'short-lived'" in str(errors[0])
    assert running(harness.pid("node-0"))


# -- errors, options, registration --------------------------------------------------------


def test_launch_errors(harness: Harness) -> None:
    scheduler = harness.scheduler()
    assert scheduler.launch(harness.spec(SLEEP), 0) == []
    with pytest.raises(SchedulerError, match="0 or more"):
        scheduler.launch(harness.spec(SLEEP), -1)
    with pytest.raises(SchedulerError, match="empty"):
        scheduler.launch(LaunchSpec(job="t", command=()), 1)
    with pytest.raises(SchedulerError, match="'no-such-agent-xyz' is not an executable file"):
        scheduler.launch(LaunchSpec(job="t", command=("no-such-agent-xyz",)), 1)
    not_a_dir = harness.tmp / "file"
    not_a_dir.write_text("")
    with pytest.raises(SchedulerError, match="cannot open the log of node-0"):
        scheduler.launch(harness.spec(SLEEP, log_dir=not_a_dir), 2)
    # Nothing was started: the numbering goes on from node-0.
    assert scheduler.launch(harness.spec("pass"), 1)[0].node_id == "node-0"


def test_options() -> None:
    options = LocalOptions.model_validate({"hosts": 4, "stop_grace": "1m30s"})
    assert (options.hosts, options.stop_grace) == (4, 90.0)
    assert LocalOptions().stop_grace == 5.0
    with pytest.raises(ValidationError):
        LocalOptions.model_validate({"host": 2})
    with pytest.raises(ValidationError):
        LocalOptions.model_validate({"hosts": -1})
    with pytest.raises(ValidationError):
        LocalOptions.model_validate({"stop_grace": "soon"})


def test_registered_through_the_entry_point(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PLANARIA_DISABLE_PLUGINS", raising=False)
    record = PluginManager.from_entry_points().resolve(PluginKind.SCHEDULER, "local")
    assert record.factory is LocalScheduler
    assert record.options is LocalOptions
    assert record.summary == "nodes are agent processes on this machine"


def test_nodes_beyond_the_slots_wait_pending_until_one_frees(harness: Harness) -> None:
    scheduler = LocalScheduler(LocalOptions(slots=2, stop_grace=1))
    try:
        handles = scheduler.launch(harness.spec(SLEEP), 3)
        assert [h.node_id for h in handles] == ["node-0", "node-1", "node-2"]
        assert handles[2].host == ""
        events = scheduler.poll(0.5)
        assert {e.node_id for e in events if e.state is NodeState.RUNNING} == {"node-0", "node-1"}
        assert scheduler.poll(0.2) == []  # node-2 still waits for a slot
        scheduler.stop(["node-0"])
        events = scheduler.poll(1.0)
        assert [(e.node_id, e.state) for e in events] == [("node-2", NodeState.RUNNING)]
        # Replacing a node that never started queues its successor instead.
        scheduler.stop(["node-1"])
        queued = scheduler.launch(harness.spec(SLEEP), 2)
        new = scheduler.replace(queued[1].node_id, exclude_host=False)
        assert new.state is NodeState.PENDING
    finally:
        scheduler.stop()
