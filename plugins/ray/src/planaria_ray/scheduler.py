"""The ``ray`` scheduler: one agent per Ray node, each run by an actor of its own.

Every node is a :class:`~planaria_ray.actor.NodeActor` placed on one chosen Ray node with a
hard ``NodeAffinitySchedulingStrategy`` and the agent's resources (``num_cpus``, ``num_gpus``,
``memory``, custom ones such as ``NPU``). The scheduler picks that Ray node itself among the
live ones that have the resources, are not excluded and hold no other node of this job: the
spread is strict (one agent per Ray node) and exclusion is by Ray node id. Node affinity,
rather than a placement group or a label selector, because a replacement must go *anywhere but*
a given node: a placement group's bundles are fixed when it is created, and label
anti-affinity needs labels the cluster's operator set up. A node chosen here that turns out
busy (another job took its resources meanwhile) is given up after ``start_timeout``.

Ray never restarts an actor of ours (``max_restarts=0``, ``max_task_retries=0``): the master
alone decides what comes in place of a lost node, and Ray's restart would be a second one.

What is seen, through two object references per node: ``ready()`` (the agent started: the
node runs) and ``wait()`` (the agent ended, with its status: succeeded or failed). When the
actor dies instead, its raylet killed, its machine gone, ``ray.kill`` from outside, ``wait()``
raises Ray's actor-died error and the node is reported ``lost`` with Ray's reason. A Ray node
is declared dead by the GCS after its health checks fail (``health_check_period_ms`` times
``health_check_failure_threshold``, 15 s by default); an agent that stops heart-beating is
the master's own finding (``master.heartbeat_timeout``).

Launched nodes that find no free Ray node wait, ``pending``, and start as soon as one joins
the cluster. A replacement with no free Ray node is an error, on which the master shrinks an
elastic job or stops it with that reason.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from planaria import leftovers
from planaria.errors import ConfigIssue
from planaria.log import get_logger
from planaria.plugin import (
    LaunchSpec,
    NodeEvent,
    NodeHandle,
    NodeState,
    Scheduler,
    SchedulerError,
    poll_events,
)
from planaria.protocol import HOST_ENV, NODE_ID_ENV
from planaria.shm import TAG_ENV
from planaria_ray import cluster
from planaria_ray.actor import NodeActor
from planaria_ray.options import RayOptions

log = get_logger("scheduler.ray")

LINGER = 60.0
"""How long a detached actor whose agent ended waits for a driver to take its status."""
_STOP_EXTRA = 10.0
"""Beyond ``stop_grace``: how long the actors get to answer a stop."""
_PENDING_LOOK = 0.5
"""How often nodes waiting for a free Ray node look for one."""


@dataclass(eq=False)
class _Node:
    node_id: str
    spec: LaunchSpec
    host: str = ""
    """The Ray node id it runs on; empty while it waits for a free one."""
    actor: Any = None
    ready: Any = None
    """The reference ``ready()`` gives, until it came."""
    done: Any = None
    """The reference ``wait()`` gives: the agent's exit, or the actor's death."""
    since: float = field(default_factory=time.monotonic)
    ask_at: float | None = None
    """When to ask ``wait()`` again, after Ray found the actor unreachable."""
    unreachable: bool = False
    """Ray found the actor unreachable (said once in the log, however long it lasts)."""
    reported: bool = False
    released: bool = False

    @property
    def name(self) -> str:
        return f"planaria.{self.spec.run_id or 'run'}.{self.node_id}"


def _exit_event(node_id: str, code: int) -> NodeEvent:
    if code == 0:
        return NodeEvent(node_id=node_id, state=NodeState.SUCCEEDED)
    if code < 0:
        return NodeEvent(
            node_id=node_id, state=NodeState.LOST, reason=f"the agent was killed by signal {-code}"
        )
    return NodeEvent(node_id=node_id, state=NodeState.FAILED, reason=f"exit code {code}")


class RayScheduler(Scheduler[RayOptions]):
    """Nodes are actors on a Ray cluster (see the module docstring)."""

    name = "ray"
    nodes_here = False

    @classmethod
    def capacity_issues(
        cls, options: RayOptions, *, nodes: int, procs_per_node: int
    ) -> list[ConfigIssue]:
        """Ray must be importable, the cluster reachable, and some node able to hold an
        agent's resources (else its actor would wait for ever)."""
        try:
            cluster.import_ray()
        except SchedulerError as exc:
            return [ConfigIssue("scheduler.backend", str(exc))]
        if options.address is None:
            return []  # a local cluster is started with what the options ask
        try:
            cluster.join(options)
            live = cluster.alive_nodes()
        except SchedulerError as exc:
            return [ConfigIssue("scheduler.options.address", str(exc))]
        if not any(cluster.fits(n, options.demand()) for n in live):
            return [ConfigIssue("scheduler.options", _no_fit(options, live))]
        return []

    def __init__(self, options: RayOptions) -> None:
        super().__init__(options)
        self._nodes: dict[str, _Node] = {}
        self._events: list[NodeEvent] = []
        self._excluded: dict[str, str] = {}
        self._next_number = 0
        self._tag = uuid.uuid4().hex[:8]
        self._local: Any = None
        """The cluster started for this run, when there is no address."""

    # -- the Scheduler interface --------------------------------------------------------

    def launch(self, spec: LaunchSpec, count: int) -> list[NodeHandle]:
        """Start ``count`` actors on free Ray nodes; those for which none is free wait."""
        if count < 0:
            raise SchedulerError(f"cannot launch {count} nodes: the count must be 0 or more")
        if not spec.command:
            raise SchedulerError("cannot launch nodes: the launch command is empty")
        if count == 0:
            return []
        self.check_interrupted("cannot launch nodes")
        self._connect(count)
        free = self._free_hosts(set())
        if not free and not any(cluster.fits(n, self.options.demand()) for n in self._live()):
            raise SchedulerError(_no_fit(self.options, cluster.alive_nodes()))
        started: list[_Node] = []
        try:
            for done in range(count):
                self.check_interrupted(f"launching stopped after {done} of {count} nodes")
                node = _Node(self._new_id(), spec)
                self._nodes[node.node_id] = node
                started.append(node)
                if free:
                    self._start(node, free.pop(0))
        except BaseException:
            self._terminate(started)
            for node in started:
                del self._nodes[node.node_id]
            raise
        return [self._handle(n) for n in started]

    def poll(self, timeout: float) -> list[NodeEvent]:
        """State changes since the last call; waits at most ``timeout`` for the first."""
        return poll_events(timeout, self._take, self._wait)

    def replace(self, node_id: str, *, exclude_host: bool) -> NodeHandle:
        """Stop ``node_id`` and start its successor on another free Ray node (on the same
        one only when none other is free, it is alive and not excluded)."""
        self.check_interrupted(f"cannot replace {node_id}")
        old = self._get(node_id)
        if old.released:
            raise SchedulerError(f"cannot replace {node_id}: it was already stopped or replaced")
        if exclude_host and old.host:
            self._exclude(old.host, f"node {node_id} was diagnosed faulty")
        others = [h for h in self._free_hosts({old.host}) if h != old.host]
        target = others[0] if others else None
        if target is None and old.host and old.host not in self._excluded:
            target = next((h for h in self._free_hosts(set(), but=old) if h == old.host), None)
        if target is None:
            raise SchedulerError(
                f"cannot replace {node_id}: no free Ray node has "
                f"{self.options.demand()} (one agent per node; excluded: "
                f"{', '.join(sorted(self._excluded)) or 'none'}); add a node to the cluster"
            )
        self._release([old])
        self._terminate([old])
        new = _Node(self._new_id(), old.spec)
        self._nodes[new.node_id] = new
        self._start(new, target)
        log.info("node replaced", node=node_id, replacement=new.node_id, ray_node=target)
        return self._handle(new)

    def stop(self, node_ids: list[str] | None = None) -> None:
        """Stop the agents (SIGTERM, SIGKILL after ``stop_grace``) and kill their actors.
        Stopping everything also ends a local cluster started for this run."""
        if node_ids is None:
            targets = list(self._nodes.values())
        else:
            targets = [self._get(node_id) for node_id in dict.fromkeys(node_ids)]
        self._release(targets)
        self._terminate(targets)
        if node_ids is None and self._local is not None:
            cluster.import_ray().shutdown()
            self._local.shutdown()
            self._local = None

    def adopt(self, spec: LaunchSpec, handles: list[NodeHandle], excluded: set[str]) -> None:
        """Find the actors of a restarted master's nodes again, by name (they are detached);
        one that is gone is reported lost by the next poll."""
        ray = cluster.import_ray()
        self._connect(len(handles))
        for host in excluded:
            self._excluded.setdefault(host, "excluded by an earlier master")
        for handle in handles:
            number = handle.node_id.removeprefix("node-")
            if number.isdigit():
                self._next_number = max(self._next_number, int(number) + 1)
            node = _Node(handle.node_id, spec, host=handle.host)
            self._nodes[node.node_id] = node
            if handle.state is NodeState.LOST:
                node.reported = True
                continue
            try:
                node.actor = ray.get_actor(node.name, namespace=self.options.namespace)
            except ValueError:
                node.reported = True
                self._events.append(
                    NodeEvent(
                        node_id=node.node_id,
                        state=NodeState.LOST,
                        reason=f"its actor {node.name} is gone (ended while no master watched)",
                    )
                )
                continue
            node.done = node.actor.wait.remote()
            log.info("node adopted", node=node.node_id, ray_node=node.host)

    def excluded_hosts(self) -> set[str]:
        return set(self._excluded)

    def node_addresses(self) -> list[str]:
        """Where the agents will run: once the cluster is joined (``planaria run`` joins it
        to check it before the master starts), the addresses of its live nodes that can hold
        an agent, then the head node's host; before, the head node's host alone (the config
        names it; a cluster's nodes share its network). ``127.0.0.1`` for the local cluster a
        run without ``address`` starts; none when the address says nothing yet (``auto``
        with no cluster started here)."""
        if self.options.address is None:
            return ["127.0.0.1"]
        found: list[str] = []
        with contextlib.suppress(Exception):  # not joined, or Ray cannot say: the head alone
            if cluster.import_ray().is_initialized():
                demand = self.options.demand()
                found = [
                    str(n["NodeManagerAddress"])
                    for n in cluster.alive_nodes()
                    if cluster.fits(n, demand) and n.get("NodeManagerAddress")
                ]
        with contextlib.suppress(SchedulerError):
            found.append(cluster.gcs_endpoint(self.options.address)[0])
        return list(dict.fromkeys(found))

    # -- the cluster ----------------------------------------------------------------------

    def _connect(self, count: int) -> None:
        ray = cluster.import_ray()
        if ray.is_initialized():
            return
        if self.options.address is None:
            self._local = cluster.start_local(self.options, self.options.local_nodes or count)
        else:
            cluster.join(self.options)

    def _live(self) -> list[dict[str, Any]]:
        return cluster.alive_nodes()

    def _free_hosts(self, also_taken: set[str], but: _Node | None = None) -> list[str]:
        """Live Ray nodes with the agent's resources, not excluded, holding no node of ours
        (``but`` not counted)."""
        taken = {
            n.host for n in self._nodes.values() if not n.released and n.host and n is not but
        } | also_taken
        demand = self.options.demand()
        return [
            n["NodeID"]
            for n in self._live()
            if n["NodeID"] not in taken
            and n["NodeID"] not in self._excluded
            and cluster.fits(n, demand)
        ]

    def _exclude(self, host: str, why: str) -> None:
        if host not in self._excluded:
            self._excluded[host] = why
            log.warning("ray node excluded", ray_node=host, why=why)

    # -- actors ---------------------------------------------------------------------------

    def _new_id(self) -> str:
        node_id = f"node-{self._next_number}"
        self._next_number += 1
        return node_id

    def _get(self, node_id: str) -> _Node:
        node = self._nodes.get(node_id)
        if node is None:
            raise SchedulerError(f"unknown node {node_id!r}: this ray scheduler never started it")
        return node

    def _handle(self, node: _Node) -> NodeHandle:
        return NodeHandle(
            node_id=node.node_id,
            host=node.host or "pending",
            data={"actor": node.name, "namespace": self.options.namespace},
        )

    def _start(self, node: _Node, host: str) -> None:
        ray = cluster.import_ray()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        spec = node.spec
        # The token travels here, in the runtime environment, never on a command line.
        env = {**spec.env, NODE_ID_ENV: node.node_id, HOST_ENV: host}
        marker = os.environ.get(leftovers.VARIABLE)
        if marker:  # what the job starts on the cluster carries the run's marker
            env.setdefault(leftovers.VARIABLE, marker)
        if tag := os.environ.get(TAG_ENV):  # and names its files in /dev/shm as the run does
            env.setdefault(TAG_ENV, tag)
        options: dict[str, Any] = {
            "num_cpus": self.options.num_cpus,
            "num_gpus": self.options.num_gpus,
            "max_restarts": 0,
            "max_task_retries": 0,
            "max_concurrency": 4,
            "name": node.name,
            "namespace": self.options.namespace,
            "runtime_env": {"env_vars": env},
            "scheduling_strategy": NodeAffinitySchedulingStrategy(host, soft=False),
        }
        if self.options.resources:
            options["resources"] = dict(self.options.resources)
        if self.options.memory:
            options["memory"] = self.options.memory
        if spec.detached:
            options["lifetime"] = "detached"
        actor_class = ray.remote(NodeActor)
        log_dir = None if spec.log_dir is None else str(spec.log_dir)
        try:
            node.actor = actor_class.options(**options).remote(
                list(spec.command), node.node_id, log_dir, LINGER, sorted(env)
            )
        except Exception as exc:
            raise SchedulerError(f"cannot create the actor of {node.node_id}: {exc}") from exc
        node.host = host
        node.since = time.monotonic()
        node.ready = node.actor.ready.remote()
        node.done = node.actor.wait.remote()
        log.info("node started", node=node.node_id, ray_node=host, actor=node.name)

    def _take(self) -> list[NodeEvent]:
        self._start_waiting()
        self._ask_again()
        self._observe()
        events, self._events = self._events, []
        return events

    def _watched(self) -> list[_Node]:
        return [n for n in self._nodes.values() if not n.released and not n.reported and n.actor]

    def _refs(self) -> list[Any]:
        refs = []
        for node in self._watched():
            refs += [r for r in (node.ready, node.done) if r is not None]
        return refs

    def _observe(self) -> None:
        ray = cluster.import_ray()
        refs = self._refs()
        if not refs:
            return
        came, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=True)
        came = set(came)
        now = time.monotonic()
        for node in self._watched():
            if node.ready is not None and node.ready in came:
                ref, node.ready = node.ready, None
                try:
                    where = ray.get(ref)
                except Exception as exc:
                    self._report(node, NodeState.FAILED, _why(exc))
                    self._kill(node)  # its actor must not hold the Ray node's resources
                    continue
                self._events.append(NodeEvent(node_id=node.node_id, state=NodeState.RUNNING))
                log.info("node running", node=node.node_id, **where)
            if node.done is not None and node.done in came:
                try:
                    code = ray.get(node.done)
                except Exception as exc:
                    if isinstance(exc, ray.exceptions.ActorUnavailableError):
                        # Unreachable, for now: its raylet may be gone, or a link down for a
                        # moment. Ray says which once the GCS knows (ActorDiedError, its node
                        # then no longer alive, so that a replacement cannot go there).
                        node.done, node.ask_at = None, now + _PENDING_LOOK
                        if not node.unreachable:
                            node.unreachable = True
                            log.info("node unreachable", node=node.node_id, reason=_why(exc))
                        continue
                    self._report(node, NodeState.LOST, _why(exc))
                    continue
                event = _exit_event(node.node_id, code)
                self._report(node, event.state, event.reason)
                self._kill(node)  # its agent ended: the actor has nothing left to do
            elif node.ready is not None and now - node.since > self.options.start_timeout:
                self._report(
                    node,
                    NodeState.FAILED,
                    f"its actor did not start on Ray node {node.host} within "
                    f"{self.options.start_timeout:g}s (resources taken, or the node cannot "
                    "start it)",
                )
                self._kill(node)

    def _report(self, node: _Node, state: NodeState, reason: str) -> None:
        node.reported = True
        node.ready = None
        self._events.append(NodeEvent(node_id=node.node_id, state=state, reason=reason))
        log.info("node ended", node=node.node_id, state=state.value, reason=reason)

    def _ask_again(self) -> None:
        now = time.monotonic()
        for node in self._watched():
            if node.ask_at is not None and now >= node.ask_at:
                node.ask_at = None
                node.done = node.actor.wait.remote()

    def _start_waiting(self) -> None:
        waiting = [n for n in self._nodes.values() if not n.released and not n.actor]
        if not waiting or self.interrupted:
            return
        free = self._free_hosts(set())
        for node in waiting[: len(free)]:
            self._start(node, free.pop(0))

    def _wait(self, remaining: float) -> None:
        ray = cluster.import_ray()
        if any(not n.released and not n.actor for n in self._nodes.values()) or any(
            n.ask_at is not None for n in self._watched()
        ):
            remaining = min(remaining, _PENDING_LOOK)
        refs = self._refs()
        if refs:
            ray.wait(refs, num_returns=1, timeout=remaining, fetch_local=False)
        else:
            time.sleep(remaining)

    def _release(self, nodes: Iterable[_Node]) -> None:
        ids = set()
        for node in nodes:
            node.released = True
            ids.add(node.node_id)
        self._events = [e for e in self._events if e.node_id not in ids]

    def _kill(self, node: _Node) -> None:
        if node.actor is None:
            return
        ray = cluster.import_ray()
        try:
            ray.kill(node.actor, no_restart=True)
        except Exception as exc:  # already gone with its node
            log.info("actor already gone", node=node.node_id, error=str(exc))

    def _terminate(self, nodes: list[_Node]) -> None:
        """Stop the agents through their actors, then kill the actors."""
        live = [n for n in nodes if n.actor is not None]
        if not live:
            return
        ray = cluster.import_ray()
        grace = self.options.stop_grace
        stops = [n.actor.stop.remote(grace) for n in live]
        try:
            ray.wait(stops, num_returns=len(stops), timeout=grace + _STOP_EXTRA)
        except Exception as exc:
            log.warning("stopping agents failed", error=str(exc))
        for node in live:
            self._kill(node)
            log.info("node stopped", node=node.node_id)


def _why(exc: BaseException) -> str:
    """Ray's reason for an actor's end, on one line."""
    text = " ".join(str(exc).split())
    return text[:500] or type(exc).__name__


def _no_fit(options: RayOptions, live: list[dict[str, Any]]) -> str:
    return (
        f"no node of the Ray cluster has the resources an agent asks for "
        f"({options.demand()}), so its actor would wait for ever; the "
        f"{len(live)} live node(s): {cluster.describe(live) or 'none'}"
    )
