"""The conformance suite of schedulers (:class:`~planaria.scheduler.api.Scheduler` plugins).

Subclass :class:`SchedulerConformance` in a test module (the class name must start with
``Test``) and provide a ``scheduler`` fixture: a fresh scheduler for one test. The suite stops
it afterwards and checks that none of its nodes' processes is left.

The suite's nodes run :meth:`SchedulerConformance.node_command`: a Python process that starts a
child deaf to SIGTERM and then both sleep, so that "no process survives" covers a node's whole
tree, stubborn processes included. Every
node's environment carries a marker (:data:`MARK_ENV`) by which the suite finds the node's
processes in ``/proc`` and kills one from outside, as a dying machine would. For a scheduler
whose nodes run elsewhere, set ``nodes_visible_here = False`` and override
:meth:`SchedulerConformance.kill_node`.

Override the ``launch_spec`` fixture when the scheduler needs more than a command and an
environment (a log directory, a run id). Capability flags say what a scheduler cannot do:
``supports_host_exclusion = False`` skips the test of replacing a node away from its host.

The suite checks what every scheduler promises, whether it is built on the engine
(:mod:`planaria.scheduler.engine`, which keeps these promises once for all its backends) or
not: distinct node ids and an error naming an unknown one, host exclusion kept, nothing started
after :meth:`~planaria.scheduler.api.Scheduler.interrupt`, each node's end reported once, and
no event of a node the caller let go of.

Example::

    class TestMyScheduler(SchedulerConformance):
        @pytest.fixture
        def scheduler(self):
            return MyScheduler(MyOptions(partition="debug"))
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import pytest

from planaria.errors import SchedulerError
from planaria.master.advertise import carried_name
from planaria.protocol import NODE_ID_ENV
from planaria.scheduler.api import LaunchSpec, NodeEvent, NodeHandle, NodeState, Scheduler
from planaria.testing.processes import environ_of, processes_with

AnyScheduler = Scheduler[Any]
SpecFactory = Callable[[Sequence[str], Mapping[str, str]], LaunchSpec]

MARK_ENV = "PLANARIA_CONFORMANCE_MARK"
"""Set in every node the suite launches, to a value unique to one test."""

TERMINAL = frozenset({NodeState.SUCCEEDED, NodeState.FAILED, NodeState.LOST})

# A node: a child that ignores SIGTERM (a worker stuck in a device call), beside a parent that
# sleeps. Both inherit the marker.
NODE_SCRIPT = textwrap.dedent(
    """
    import subprocess, sys, time
    subprocess.Popen([sys.executable, "-c", CHILD])
    time.sleep(3600)
    """
).replace(
    "CHILD",
    repr("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(3600)"),
)


def marked_processes(mark: str) -> dict[int, str]:
    """Live processes of this machine whose environment holds ``MARK_ENV=mark``: their pids
    and node ids."""
    found: dict[int, str] = {}
    for pid in processes_with({f"{MARK_ENV}={mark}".encode()}):
        node = f"{NODE_ID_ENV}=".encode()
        ids = [e[len(node) :] for e in environ_of(pid) if e.startswith(node)]
        found[pid] = ids[0].decode() if ids else ""
    return found


class Cluster:
    """The nodes of one test: launches them with the marker, collects their events, finds and
    kills their processes."""

    def __init__(
        self, scheduler: AnyScheduler, make_spec: SpecFactory, command: Sequence[str]
    ) -> None:
        self.scheduler = scheduler
        self.mark = uuid.uuid4().hex
        self.command = list(command)
        self.make_spec = make_spec
        self.events: list[NodeEvent] = []

    def spec(self, command: Sequence[str] | None = None) -> LaunchSpec:
        spec = self.make_spec(command or self.command, {MARK_ENV: self.mark})
        if spec.env.get(MARK_ENV) != self.mark:  # a factory that dropped the environment
            spec = spec.model_copy(update={"env": {**spec.env, MARK_ENV: self.mark}})
        return spec

    def launch(self, count: int, command: Sequence[str] | None = None) -> list[NodeHandle]:
        return self.scheduler.launch(self.spec(command), count)

    def poll(self, timeout: float) -> list[NodeEvent]:
        events = self.scheduler.poll(timeout)
        self.events += events
        return events

    def wait_for(
        self, node_id: str, states: frozenset[NodeState] | set[NodeState], timeout: float
    ) -> NodeEvent:
        """The first event of ``node_id`` (seen already or to come) in one of ``states``."""
        deadline = time.monotonic() + timeout
        seen = 0
        while True:
            for event in self.events[seen:]:
                if event.node_id == node_id and event.state in states:
                    return event
            seen = len(self.events)
            left = deadline - time.monotonic()
            if left <= 0:
                mine = [e for e in self.events if e.node_id == node_id]
                pytest.fail(
                    f"{node_id} reached none of {sorted(s.value for s in states)} within "
                    f"{timeout:g}s; its events: {mine}"
                )
            self.poll(min(left, 1.0))

    def processes(self, node_id: str | None = None) -> list[int]:
        return sorted(
            pid
            for pid, node in marked_processes(self.mark).items()
            if node_id is None or node == node_id
        )

    def wait_processes(
        self, predicate: Callable[[list[int]], bool], node_id: str | None, timeout: float
    ) -> list[int]:
        deadline = time.monotonic() + timeout
        while True:
            pids = self.processes(node_id)
            if predicate(pids) or time.monotonic() > deadline:
                return pids
            time.sleep(0.02)


class SchedulerConformance:
    """Tests every scheduler must pass; see the module docstring."""

    supports_host_exclusion: ClassVar[bool] = True
    nodes_visible_here: ClassVar[bool] = True
    """The nodes' processes run on this machine, where ``/proc`` shows them."""
    loss_states: ClassVar[frozenset[NodeState]] = frozenset({NodeState.LOST, NodeState.FAILED})
    """What a node whose processes were killed from outside may be reported as."""
    start_timeout: ClassVar[float] = 60.0
    """How long a node may take to run, or to be reported after it ended."""
    stop_timeout: ClassVar[float] = 30.0
    """How long after :meth:`~planaria.scheduler.api.Scheduler.stop` returned a node's
    processes may still be seen (being reaped by whoever adopted them)."""
    poll_timeout: ClassVar[float] = 0.5

    # -- what the subclass provides ----------------------------------------------------------

    @pytest.fixture
    def scheduler(self) -> AnyScheduler:
        pytest.fail("a SchedulerConformance subclass must define a `scheduler` fixture")

    @pytest.fixture
    def launch_spec(self) -> SpecFactory:
        """``make(command, env) -> LaunchSpec``: what the scheduler's nodes run."""

        def make(command: Sequence[str], env: Mapping[str, str]) -> LaunchSpec:
            return LaunchSpec(job="conformance", command=tuple(command), env=dict(env))

        return make

    def node_command(self) -> list[str]:
        """A node that lives until it is stopped, with a child of its own."""
        return [sys.executable, "-c", NODE_SCRIPT]

    def exit_command(self, code: int) -> list[str]:
        """A node that exits at once with ``code``."""
        return [sys.executable, "-c", f"import sys; sys.exit({code})"]

    def kill_node(self, cluster: Cluster, handle: NodeHandle) -> None:
        """Kill every process of the node from outside, as a machine that died would."""
        if not self.nodes_visible_here:
            pytest.fail("with nodes_visible_here = False, override kill_node()")
        pids = cluster.wait_processes(lambda p: len(p) >= 2, handle.node_id, self.start_timeout)
        assert pids, f"no process of {handle.node_id} found to kill"
        # Until none is left: a child its parent was starting as the first ones were found
        # (a busy machine) would outlive a single sweep, which a dead machine's would not.
        deadline = time.monotonic() + self.stop_timeout
        while pids:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
                    os.kill(pid, signal.SIGKILL)
            assert time.monotonic() < deadline, f"{handle.node_id}'s {pids} survived SIGKILL"
            pids = cluster.wait_processes(lambda p: not p, handle.node_id, 0.5)

    @pytest.fixture
    def cluster(self, scheduler: AnyScheduler, launch_spec: SpecFactory) -> Iterator[Cluster]:
        cluster = Cluster(scheduler, launch_spec, self.node_command())
        try:
            yield cluster
        finally:
            scheduler.stop()
        if self.nodes_visible_here:
            left = cluster.wait_processes(lambda p: not p, None, self.stop_timeout)
            assert not left, f"processes of stopped nodes outlived stop(): {left}"

    # -- helpers -----------------------------------------------------------------------------

    def running(self, cluster: Cluster, count: int) -> list[NodeHandle]:
        """Launch ``count`` nodes and wait until each runs, with its child."""
        handles = cluster.launch(count)
        for handle in handles:
            cluster.wait_for(handle.node_id, {NodeState.RUNNING}, self.start_timeout)
            if self.nodes_visible_here:
                pids = cluster.wait_processes(
                    lambda p: len(p) >= 2, handle.node_id, self.start_timeout
                )
                assert len(pids) >= 2, f"{handle.node_id} runs {pids}, expected it and its child"
        return handles

    def _need_proc(self) -> None:
        if not self.nodes_visible_here:
            pytest.skip("the nodes run elsewhere: their processes cannot be seen here")

    # -- launch and poll ---------------------------------------------------------------------

    def test_launch_reports_each_node_running(self, cluster: Cluster) -> None:
        handles = cluster.launch(3)
        assert len(handles) == 3
        ids = [h.node_id for h in handles]
        assert len(set(ids)) == 3, f"node ids must be distinct: {ids}"
        assert all(h.state in (NodeState.PENDING, NodeState.RUNNING) for h in handles)
        for handle in handles:
            cluster.wait_for(handle.node_id, {NodeState.RUNNING}, self.start_timeout)
        if self.nodes_visible_here:
            for handle in handles:
                pids = cluster.wait_processes(bool, handle.node_id, self.start_timeout)
                assert pids, f"{handle.node_id} runs no process with {NODE_ID_ENV} set to its id"
        unknown = {e.node_id for e in cluster.events} - set(ids)
        assert not unknown, f"events of nodes that were never launched: {unknown}"

    def test_node_addresses_before_a_launch_then_a_launch(self, cluster: Cluster) -> None:
        """Asked before any node starts, as a master bound to every interface asks: IP
        addresses or DNS names a certificate can carry (none when it cannot tell), never an
        error; and the nodes launch as usual after it."""
        addresses = cluster.scheduler.node_addresses()
        assert isinstance(addresses, list), addresses
        bad = [a for a in addresses if not isinstance(a, str) or not carried_name(a)]
        assert not bad, f"node_addresses() gave what is no address or name: {bad}"
        self.running(cluster, 1)

    def test_launch_of_no_node(self, cluster: Cluster) -> None:
        assert cluster.launch(0) == []
        assert cluster.poll(0) == []

    def test_a_node_s_exit_is_reported(self, cluster: Cluster) -> None:
        (done,) = cluster.launch(1, self.exit_command(0))
        (broken,) = cluster.launch(1, self.exit_command(3))
        ok = cluster.wait_for(done.node_id, TERMINAL, self.start_timeout)
        bad = cluster.wait_for(broken.node_id, TERMINAL, self.start_timeout)
        assert ok.state is NodeState.SUCCEEDED, ok
        assert bad.state is NodeState.FAILED, bad

    def test_poll_never_blocks_past_its_timeout(self, cluster: Cluster) -> None:
        self.running(cluster, 1)
        while cluster.poll(0):  # drain what is pending
            pass
        timeout = self.poll_timeout
        timings = []
        for _ in range(3):
            started = time.monotonic()
            assert cluster.poll(timeout) == []
            timings.append(time.monotonic() - started)
        # The best of three, so that one scheduling hiccup of a busy machine does not decide.
        assert min(timings) <= 2 * timeout, f"poll({timeout:g}) took {timings}"
        started = time.monotonic()
        assert cluster.poll(0) == []
        assert time.monotonic() - started <= 2 * timeout

    def test_a_node_ends_once(self, cluster: Cluster) -> None:
        (done,) = cluster.launch(1, self.exit_command(0))
        cluster.wait_for(done.node_id, TERMINAL, self.start_timeout)
        cluster.poll(self.poll_timeout)
        ends = [e for e in cluster.events if e.node_id == done.node_id and e.state in TERMINAL]
        assert len(ends) == 1, f"{done.node_id} was reported ended more than once: {ends}"

    # -- the scheduler's own rules -----------------------------------------------------------

    def test_an_unknown_node_id_is_an_error_naming_it(self, cluster: Cluster) -> None:
        self.running(cluster, 1)
        for what, call in (
            ("stop", lambda: cluster.scheduler.stop(["node-no-such"])),
            ("replace", lambda: cluster.scheduler.replace("node-no-such", exclude_host=False)),
        ):
            with pytest.raises(SchedulerError) as raised:
                call()
            assert "node-no-such" in str(raised.value), f"{what}: {raised.value}"

    def test_after_interrupt_nothing_starts(self, cluster: Cluster) -> None:
        """A stopping job's scheduler starts nothing more; stopping it still works (the
        suite stops it afterwards and checks that no process is left)."""
        (running,) = self.running(cluster, 1)
        cluster.scheduler.interrupt()
        with pytest.raises(SchedulerError, match="stopping"):
            cluster.launch(1)
        with pytest.raises(SchedulerError, match="stopping"):
            cluster.scheduler.replace(running.node_id, exclude_host=False)

    # -- node loss ---------------------------------------------------------------------------

    def test_a_node_killed_from_outside_is_reported_lost(self, cluster: Cluster) -> None:
        victim, survivor = self.running(cluster, 2)
        self.kill_node(cluster, victim)
        event = cluster.wait_for(victim.node_id, TERMINAL, self.start_timeout)
        assert event.state in self.loss_states, event
        assert event.reason, f"a lost node's event says why: {event}"
        assert not [
            e for e in cluster.events if e.node_id == survivor.node_id and e.state in TERMINAL
        ], "the other node was reported gone too"
        if self.nodes_visible_here:
            assert cluster.processes(survivor.node_id)

    # -- replace -----------------------------------------------------------------------------

    def _replace(self, cluster: Cluster, exclude_host: bool) -> tuple[NodeHandle, NodeHandle]:
        old, _ = self.running(cluster, 2)
        new = cluster.scheduler.replace(old.node_id, exclude_host=exclude_host)
        assert new.node_id != old.node_id
        replaced = len(cluster.events)
        cluster.wait_for(new.node_id, {NodeState.RUNNING}, self.start_timeout)
        if self.nodes_visible_here:
            left = cluster.wait_processes(lambda p: not p, old.node_id, self.stop_timeout)
            assert not left, f"processes of the replaced {old.node_id} live on: {left}"
            assert cluster.wait_processes(bool, new.node_id, self.start_timeout)
        cluster.poll(self.poll_timeout)
        late = [e for e in cluster.events[replaced:] if e.node_id == old.node_id]
        assert not late, f"events of a replaced node: {late}"
        return old, new

    def test_replace_without_excluding_the_host(self, cluster: Cluster) -> None:
        old, _ = self._replace(cluster, exclude_host=False)
        assert old.host not in cluster.scheduler.excluded_hosts()

    def test_replace_excluding_the_host(self, cluster: Cluster) -> None:
        if not self.supports_host_exclusion:
            pytest.skip("this scheduler cannot keep a node off a host")
        old, new = self._replace(cluster, exclude_host=True)
        assert old.host in cluster.scheduler.excluded_hosts()
        assert new.host != old.host
        (later,) = cluster.launch(1)
        assert later.host != old.host

    # -- stop --------------------------------------------------------------------------------

    def test_stop_leaves_no_process(self, cluster: Cluster) -> None:
        self._need_proc()
        first, second = self.running(cluster, 2)
        cluster.scheduler.stop([first.node_id])
        left = cluster.wait_processes(lambda p: not p, first.node_id, self.stop_timeout)
        assert not left, f"processes of the stopped {first.node_id} live on: {left}"
        assert cluster.processes(second.node_id), "stopping one node stopped another"
        cluster.scheduler.stop()
        left = cluster.wait_processes(lambda p: not p, None, self.stop_timeout)
        assert not left, f"processes of stopped nodes live on: {left}"

    def test_stop_is_idempotent_and_silences_the_nodes(self, cluster: Cluster) -> None:
        handles = self.running(cluster, 2)
        ids = [h.node_id for h in handles]
        cluster.scheduler.stop()
        stopped = len(cluster.events)
        cluster.scheduler.stop()
        cluster.scheduler.stop(ids)
        cluster.scheduler.stop([ids[0]])
        cluster.poll(self.poll_timeout)
        late = [e for e in cluster.events[stopped:] if e.node_id in ids]
        assert not late, f"events of stopped nodes: {late}"
