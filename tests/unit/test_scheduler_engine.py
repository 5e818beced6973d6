"""The scheduler engine's promises, on a backend that keeps its nodes in memory: a cluster of a
few named hosts with one slot each, whose agents end when the test says so."""

from __future__ import annotations

import threading
from collections.abc import Iterable

import pytest
from pydantic import BaseModel

from planaria.errors import SchedulerError
from planaria.scheduler.api import LaunchSpec, NodeEvent, NodeState
from planaria.scheduler.engine import (
    EngineNode,
    EngineScheduler,
    Unplaceable,
    exit_event,
)

SPEC = LaunchSpec(job="engine", command=("agent",))


class MemoryOptions(BaseModel):
    hosts: list[str] = ["a", "b", "c"]
    stop_grace: float = 2.0


class Agent:
    """What the memory backend "runs": an agent that lives until stopped or told to exit."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.exit: int | None = None
        self.terminated_with: float | None = None


class MemoryScheduler(EngineScheduler[MemoryOptions, Agent]):
    """One agent per host; a node without a free host waits."""

    name = "memory"

    def __init__(self, options: MemoryOptions | None = None) -> None:
        super().__init__(options or MemoryOptions())
        self.agents: dict[str, Agent] = {}
        self.placed: list[tuple[str, frozenset[str]]] = []
        self.fail_start: set[str] = set()
        self.on_start: dict[str, object] = {}
        self.excluded_told: list[str] = []
        self.repeat_exits = False

    def place(
        self, node: EngineNode[Agent], avoid: frozenset[str], replacing: EngineNode[Agent] | None
    ) -> str | None:
        self.placed.append((node.node_id, avoid))
        allowed = [h for h in self.options.hosts if h not in avoid]
        if not allowed:
            raise Unplaceable(f"every host is excluded ({', '.join(sorted(avoid))})")
        taken = {n.host for n in self.live() if n is not replacing}
        return next((h for h in allowed if h not in taken), None)

    def start(self, node: EngineNode[Agent]) -> Agent:
        action = self.on_start.get(node.node_id)
        if callable(action):
            action()
        if node.node_id in self.fail_start:
            raise SchedulerError(f"cannot start {node.node_id}: the host refused")
        agent = Agent(node.host)
        self.agents[node.node_id] = agent
        self.report(node, NodeState.RUNNING)
        return agent

    def terminate(self, nodes: list[EngineNode[Agent]], grace: float) -> None:
        for node in nodes:
            assert node.data is not None, "terminate is given started nodes only"
            if node.data.exit is None and node.data.terminated_with is None:
                node.data.terminated_with = grace

    def observe(self) -> Iterable[NodeEvent]:
        return [
            exit_event(n.node_id, n.data.exit)
            for n in self.nodes.values()
            if n.data is not None
            and n.data.exit is not None
            and (self.repeat_exits or n.state is NodeState.RUNNING)
        ]

    def on_exclude(self, host: str, why: str) -> None:
        self.excluded_told.append(host)


def drain(scheduler: MemoryScheduler) -> list[NodeEvent]:
    events = []
    while batch := scheduler.poll(0):
        events += batch
    return events


def test_launch_places_each_node_and_reports_it_running() -> None:
    scheduler = MemoryScheduler()
    handles = scheduler.launch(SPEC, 2)
    assert [(h.node_id, h.host, h.state) for h in handles] == [
        ("node-0", "a", NodeState.PENDING),
        ("node-1", "b", NodeState.PENDING),
    ]
    assert drain(scheduler) == [
        NodeEvent(node_id="node-0", state=NodeState.RUNNING),
        NodeEvent(node_id="node-1", state=NodeState.RUNNING),
    ]
    assert scheduler.launch(SPEC, 0) == []


def test_bad_counts_and_specs_are_refused_before_anything_starts() -> None:
    scheduler = MemoryScheduler()
    with pytest.raises(SchedulerError, match="cannot launch -1 nodes"):
        scheduler.launch(SPEC, -1)
    with pytest.raises(SchedulerError, match="the launch command is empty"):
        scheduler.launch(LaunchSpec(job="engine", command=()), 1)
    assert scheduler.nodes == {}


def test_an_unknown_id_is_an_error_naming_it() -> None:
    scheduler = MemoryScheduler()
    scheduler.launch(SPEC, 1)
    for call in (
        lambda: scheduler.stop(["node-7"]),
        lambda: scheduler.replace("node-7", exclude_host=False),
    ):
        with pytest.raises(SchedulerError, match="unknown node 'node-7': this memory scheduler"):
            call()


def test_a_launch_that_fails_midway_releases_what_it_started() -> None:
    scheduler = MemoryScheduler()
    scheduler.fail_start = {"node-2"}
    with pytest.raises(SchedulerError, match="cannot start node-2"):
        scheduler.launch(SPEC, 3)
    assert [a.terminated_with for a in scheduler.agents.values()] == [0.0, 0.0]
    assert scheduler.nodes == {}
    assert drain(scheduler) == [], "no event of a node the failed launch started"
    scheduler.fail_start = set()
    (handle,) = scheduler.launch(SPEC, 1)
    assert handle.node_id == "node-0", "the ids of a failed launch are given out again"


def test_interrupt_stops_a_launch_between_two_nodes() -> None:
    scheduler = MemoryScheduler()
    # Another thread interrupts while the second node starts, as a stopping job does.
    interrupter = threading.Thread(target=scheduler.interrupt)
    scheduler.on_start["node-1"] = lambda: (interrupter.start(), interrupter.join())
    with pytest.raises(SchedulerError, match="launching stopped after 2 of 3 nodes"):
        scheduler.launch(SPEC, 3)
    assert sorted(scheduler.agents) == ["node-0", "node-1"]
    assert all(a.terminated_with == 0.0 for a in scheduler.agents.values())
    with pytest.raises(SchedulerError, match="the job is stopping"):
        scheduler.launch(SPEC, 1)
    with pytest.raises(SchedulerError, match="the job is stopping"):
        scheduler.replace("node-0", exclude_host=False)
    scheduler.stop()  # still works


def test_replace_excludes_the_host_for_good_and_tells_the_backend_once() -> None:
    scheduler = MemoryScheduler()
    old, other = scheduler.launch(SPEC, 2)
    new = scheduler.replace(old.node_id, exclude_host=True)
    assert (new.node_id, new.host) == ("node-2", "c")
    assert scheduler.excluded_hosts() == {"a"}
    assert scheduler.excluded_told == ["a"]
    assert scheduler.agents[old.node_id].terminated_with == 2.0
    assert all("a" in avoid for _, avoid in scheduler.placed[2:])
    scheduler.stop([other.node_id])
    (later,) = scheduler.launch(SPEC, 1)
    assert later.host == "b", "an excluded host is never placed on again"
    events = drain(scheduler)
    assert {e.node_id for e in events} == {new.node_id, later.node_id}, events


def test_replace_without_a_host_changes_nothing() -> None:
    scheduler = MemoryScheduler(MemoryOptions(hosts=["a"]))
    (old,) = scheduler.launch(SPEC, 1)
    with pytest.raises(
        SchedulerError, match=r"cannot replace node-0: every host is excluded \(a\)"
    ):
        scheduler.replace(old.node_id, exclude_host=True)
    assert scheduler.excluded_hosts() == set()
    assert scheduler.agents["node-0"].terminated_with is None
    assert not scheduler.node("node-0").released
    new = scheduler.replace(old.node_id, exclude_host=False)
    assert (new.node_id, new.host) == ("node-1", "a"), "the old node's place is free again"
    with pytest.raises(SchedulerError, match="already stopped or replaced"):
        scheduler.replace(old.node_id, exclude_host=False)


def test_nodes_without_a_free_host_wait_and_start_from_a_poll() -> None:
    scheduler = MemoryScheduler(MemoryOptions(hosts=["a"]))
    first, second = scheduler.launch(SPEC, 2)
    assert (second.host, second.state) == ("", NodeState.PENDING)
    assert drain(scheduler) == [NodeEvent(node_id=first.node_id, state=NodeState.RUNNING)]
    scheduler.agents[first.node_id].exit = 0
    assert drain(scheduler) == [
        NodeEvent(node_id=first.node_id, state=NodeState.SUCCEEDED),
        NodeEvent(node_id=second.node_id, state=NodeState.RUNNING),
    ]
    assert scheduler.node(second.node_id).host == "a"
    # A waiting node replaced: the new one waits in its place, nothing was started.
    (third,) = scheduler.launch(SPEC, 1)
    fourth = scheduler.replace(third.node_id, exclude_host=False)
    assert (fourth.host, fourth.state) == ("", NodeState.PENDING)
    scheduler.stop([fourth.node_id])
    scheduler.agents[second.node_id].exit = 3
    assert drain(scheduler) == [
        NodeEvent(node_id=second.node_id, state=NodeState.FAILED, reason="exit code 3")
    ]
    assert "node-3" not in scheduler.agents, "a stopped waiting node never starts"


def test_each_node_ends_once_and_a_released_one_is_silent() -> None:
    scheduler = MemoryScheduler()
    scheduler.repeat_exits = True  # a backend that says the same end at every look
    done, stopped = scheduler.launch(SPEC, 2)
    scheduler.agents[done.node_id].exit = -9
    scheduler.agents[stopped.node_id].exit = 1
    scheduler.stop([stopped.node_id])
    events = drain(scheduler)
    assert events == [
        NodeEvent(node_id=done.node_id, state=NodeState.RUNNING),
        NodeEvent(node_id=done.node_id, state=NodeState.LOST, reason="killed by SIGKILL"),
    ]
    assert scheduler.poll(0.05) == []


def test_one_owner_thread_when_the_backend_asks_for_it() -> None:
    class Bound(MemoryScheduler):
        owner_thread = "its agents die with the thread that started them"

    scheduler = Bound()
    scheduler.launch(SPEC, 1)
    errors: list[BaseException] = []

    def other() -> None:
        try:
            scheduler.launch(SPEC, 1)
        except SchedulerError as exc:
            errors.append(exc)

    thread = threading.Thread(target=other, name="intruder")
    thread.start()
    thread.join()
    (error,) = errors
    assert "the memory scheduler starts processes from one long-lived thread" in str(error)
    assert "called from 'intruder'" in str(error) and "must stay the only one" in str(error)
    scheduler.stop()


@pytest.mark.parametrize(
    ("code", "who", "shell", "state", "reason"),
    [
        (0, "", False, NodeState.SUCCEEDED, ""),
        (3, "", False, NodeState.FAILED, "exit code 3"),
        (-9, "", False, NodeState.LOST, "killed by SIGKILL"),
        (-15, "srun", True, NodeState.LOST, "srun killed by SIGTERM"),
        (137, "srun", True, NodeState.LOST, "the agent killed by SIGKILL"),
        (137, "", False, NodeState.FAILED, "exit code 137"),
    ],
)
def test_exit_codes_and_signals_have_one_wording(
    code: int, who: str, shell: bool, state: NodeState, reason: str
) -> None:
    assert exit_event("node-0", code, who=who, shell=shell) == NodeEvent(
        node_id="node-0", state=state, reason=reason
    )
