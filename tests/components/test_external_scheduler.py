"""The ``external`` scheduler: nodes started outside planaria are admitted up to the job's
size, a lost one is waited for rather than replaced, and the one agent it starts (the master's
own node) is reported when it ends and stopped with its whole group."""

from __future__ import annotations

import sys
import time

import pytest

from planaria.errors import SchedulerError
from planaria.process import running
from planaria.scheduler.api import LaunchSpec, NodeState
from planaria.scheduler.external import ExternalOptions, ExternalScheduler


def _spec(tmp_path, code: str) -> LaunchSpec:
    return LaunchSpec(job="ext", command=(sys.executable, "-c", code), log_dir=tmp_path)


def _events(scheduler: ExternalScheduler, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        events = scheduler.poll(0.1)
        if events:
            return events
    return []


def test_nodes_are_admitted_up_to_the_job_s_size_and_a_lost_one_is_waited_for(tmp_path):
    scheduler = ExternalScheduler(ExternalOptions())
    assert scheduler.launch(_spec(tmp_path, "pass"), 2) == []  # nothing started
    assert scheduler.admit("node-a", "ha").state is NodeState.RUNNING
    assert scheduler.admit("node-b", "hb").node_id == "node-b"
    assert scheduler.admit("node-a", "ha").node_id == "node-a"  # again: the same slot
    with pytest.raises(SchedulerError, match=r"has its 2 node\(s\) already.*node-a, node-b"):
        scheduler.admit("node-c", "hc")
    # Lost: its slot stays open for the same launcher, under the same id.
    waited = scheduler.replace("node-b", exclude_host=False)
    assert (waited.node_id, waited.host, waited.state) == ("node-b", "hb", NodeState.PENDING)
    with pytest.raises(SchedulerError, match="node-a, node-b"):  # node-b is waited for
        scheduler.admit("node-c", "hc")
    # Diagnosed bad: out for good, and its slot goes to another node.
    with pytest.raises(SchedulerError, match="its host hb was diagnosed bad"):
        scheduler.replace("node-b", exclude_host=True)
    assert scheduler.admit("node-c", "hc").node_id == "node-c"
    scheduler.stop(["node-a"])
    assert scheduler.admit("node-d", "hd").node_id == "node-d"
    assert scheduler.poll(0.0) == []
    scheduler.stop()


def test_the_agent_here_is_reported_when_it_ends(tmp_path):
    scheduler = ExternalScheduler(ExternalOptions(here="node-0", host="head"))
    (handle,) = scheduler.launch(_spec(tmp_path, "import sys; print('agent'); sys.exit(3)"), 2)
    assert (handle.node_id, handle.host) == ("node-0", "head")
    (event,) = _events(scheduler)
    assert (event.node_id, event.state) == ("node-0", NodeState.FAILED)
    assert "exited with 3" in event.reason
    assert "agent" in (tmp_path / "node-0.log").read_text()
    with pytest.raises(SchedulerError, match="this launcher's own node"):
        scheduler.replace("node-0", exclude_host=False)
    scheduler.stop()


def test_stopping_ends_the_agent_here_and_what_it_started(tmp_path):
    child = tmp_path / "child.pid"
    code = (
        "import signal, subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)']); "
        f"open({str(child)!r}, 'w').write(str(p.pid)); time.sleep(600)"
    )
    scheduler = ExternalScheduler(ExternalOptions(here="node-0"))
    (handle,) = scheduler.launch(_spec(tmp_path, code), 1)
    deadline = time.monotonic() + 20
    while not child.exists() or not child.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    pids = [int(handle.data["pid"]), int(child.read_text())]
    assert all(running(p) for p in pids)
    scheduler.stop()
    assert not any(running(p) for p in pids)
