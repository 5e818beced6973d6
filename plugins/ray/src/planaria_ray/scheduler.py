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

A node's handle carries the labels of the Ray node it is placed on (``topology_labels``, or
every label but Ray's own), for a rank placement by switch (``rendezvous.backend:
topology``): ``ray start --labels switch=s1`` on each machine says where it stands.

Launched nodes that find no free Ray node wait, ``pending``, and start as soon as one joins
the cluster. A replacement with no free Ray node is an error, on which the master shrinks an
elastic job or stops it with that reason.

The node table, ids, exclusion, the event queue and the launch, replace and stop templates are
the scheduler engine's (:mod:`planaria.scheduler.engine`); what is here is what Ray does
differently: choosing a free Ray node, starting and watching an actor, stopping it.

Why one module: those four are one idea, a node as an actor pinned to a Ray node, and each
reads the same two references per node; this docstring is a fifth of it.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import Any

from planaria import leftovers
from planaria.errors import ConfigIssue
from planaria.log import get_logger
from planaria.plugin import (
    EngineNode,
    EngineScheduler,
    LaunchSpec,
    NodeEvent,
    NodeHandle,
    NodeState,
    SchedulerError,
    Unplaceable,
    exit_event,
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
class _Actor:
    """A started node's actor (the engine's data of the node) and what is watched of it."""

    handle: Any
    """The actor; None for an adopted node whose actor was gone."""
    ready: Any = None
    """The reference ``ready()`` gives, until it came."""
    done: Any = None
    """The reference ``wait()`` gives: the agent's exit, or the actor's death."""
    since: float = field(default_factory=time.monotonic)
    ask_at: float | None = None
    """When to ask ``wait()`` again, after Ray found the actor unreachable."""
    unreachable: bool = False
    """Ray found the actor unreachable (said once in the log, however long it lasts)."""
    killed: bool = False
    """Killed by this scheduler (``ray.kill`` once is enough)."""


_RayNode = EngineNode[_Actor]


def _actor_name(spec: LaunchSpec, node_id: str) -> str:
    """The detached actor's name, by which a restarted master finds it again."""
    return f"planaria.{spec.run_id or 'run'}.{node_id}"


class RayScheduler(EngineScheduler[RayOptions, _Actor]):
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
        self._local: Any = None
        """The cluster started for this run, when there is no address."""
        self._topology: dict[str, dict[str, str]] = {}
        """Each Ray node's topology, by id, as last listed: a Ray node's labels are set when
        it starts, and do not change."""

    # -- the Scheduler interface, beyond the engine's --------------------------------------

    def adopt(self, spec: LaunchSpec, handles: list[NodeHandle], excluded: set[str]) -> None:
        """Find the actors of a restarted master's nodes again, by name (they are detached);
        one that is gone is reported lost by the next poll, one that waited for a free Ray
        node waits again."""
        ray = cluster.import_ray()
        self._connect(len(handles))
        self.keep_excluded(excluded)
        for handle in handles:
            if handle.state is NodeState.LOST:
                self.add_adopted(handle, spec, None)
                continue
            name = _actor_name(spec, handle.node_id)
            try:
                actor = ray.get_actor(name, namespace=self.options.namespace)
            except ValueError:
                if handle.host in ("", "pending"):  # it never started: it waits again
                    self.add_adopted(handle, spec, None)
                    continue
                node = self.add_adopted(handle, spec, _Actor(None, killed=True))
                self.report(
                    node,
                    NodeState.LOST,
                    f"its actor {name} is gone (ended while no master watched)",
                )
                continue
            self.add_adopted(handle, spec, _Actor(actor, done=actor.wait.remote()))
            log.info("node adopted", node=handle.node_id, ray_node=handle.host)

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

    # -- checks -----------------------------------------------------------------------------

    def check_room(self, count: int) -> None:
        """Join the cluster (or start the local one), and refuse a launch no live Ray node can
        hold an agent of: its actor would wait for ever."""
        self._connect(count)
        live = cluster.alive_nodes()
        if not any(cluster.fits(n, self.options.demand()) for n in live):
            raise SchedulerError(_no_fit(self.options, live))

    def _connect(self, count: int) -> None:
        ray = cluster.import_ray()
        if ray.is_initialized():
            return
        if self.options.address is None:
            self._local = cluster.start_local(self.options, self.options.local_nodes or count)
        else:
            cluster.join(self.options)

    # -- placement --------------------------------------------------------------------------

    def place(
        self, node: _RayNode, avoid: frozenset[str], replacing: _RayNode | None
    ) -> str | None:
        """A live Ray node with the agent's resources, outside ``avoid``, holding no node of
        ours; a replacement goes to its predecessor's Ray node only when no other is free,
        and finding none is an error (the master shrinks the job or stops it)."""
        avoid = avoid | self.excluded_hosts()
        taken = {
            n.host for n in self.nodes.values() if not n.released and n.host and n is not replacing
        }
        demand = self.options.demand()
        live = cluster.alive_nodes()
        self._remember(live)
        free = [
            str(n["NodeID"])
            for n in live
            if n["NodeID"] not in taken and n["NodeID"] not in avoid and cluster.fits(n, demand)
        ]
        if replacing is None:
            return free[0] if free else None
        if not free:
            raise Unplaceable(
                f"no free Ray node has {demand} (one agent per node; excluded: "
                f"{', '.join(sorted(avoid)) or 'none'}); add a node to the cluster"
            )
        return sorted(free, key=lambda host: host == replacing.host)[0]

    def handle_topology(self, node: _RayNode) -> dict[str, str]:
        """The topology of the Ray node the node is placed on (see the module docstring);
        empty while it waits for one."""
        if not node.host:
            return {}
        if node.host not in self._topology:
            self._remember(cluster.alive_nodes())
        return dict(self._topology.get(node.host, {}))

    def _remember(self, live: list[dict[str, Any]]) -> None:
        wanted = self.options.topology_labels
        for found in live:
            self._topology[str(found["NodeID"])] = cluster.node_topology(found, wanted)

    # -- actors -----------------------------------------------------------------------------

    def start(self, node: _RayNode) -> _Actor:
        """Create the node's actor on the chosen Ray node; it starts the agent."""
        ray = cluster.import_ray()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        spec, host, name = node.spec, node.host, _actor_name(node.spec, node.node_id)
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
            "name": name,
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
            handle = actor_class.options(**options).remote(
                list(spec.command), node.node_id, log_dir, LINGER, sorted(env)
            )
        except Exception as exc:
            raise SchedulerError(f"cannot create the actor of {node.node_id}: {exc}") from exc
        log.info("node started", node=node.node_id, ray_node=host, actor=name)
        return _Actor(handle, ready=handle.ready.remote(), done=handle.wait.remote())

    def handle_data(self, node: _RayNode) -> dict[str, str]:
        """The actor's name and namespace: a restarted master finds it by them."""
        return {"actor": _actor_name(node.spec, node.node_id), "namespace": self.options.namespace}

    def observe(self) -> list[NodeEvent]:
        """What the ``ready()`` and ``wait()`` references of the watched actors say."""
        watched = self.live()
        now = time.monotonic()
        for node in watched:  # ask again those Ray found unreachable
            actor = _data(node)
            if actor.ask_at is not None and now >= actor.ask_at:
                actor.ask_at = None
                actor.done = actor.handle.wait.remote()
        refs = _refs(watched)
        if not refs:
            return []
        ray = cluster.import_ray()
        came = set(ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=True)[0])
        events: list[NodeEvent] = []
        for node in watched:
            actor = _data(node)
            if actor.ready is not None and actor.ready in came:
                ref, actor.ready = actor.ready, None
                try:
                    where = ray.get(ref)
                except Exception as exc:
                    events.append(self._ended(node, NodeState.FAILED, _why(exc)))
                    self._kill(node)  # its actor must not hold the Ray node's resources
                    continue
                events.append(NodeEvent(node_id=node.node_id, state=NodeState.RUNNING))
                log.info("node running", node=node.node_id, **where)
            if actor.done is not None and actor.done in came:
                try:
                    code = ray.get(actor.done)
                except Exception as exc:
                    if isinstance(exc, ray.exceptions.ActorUnavailableError):
                        # Unreachable, for now: its raylet may be gone, or a link down for a
                        # moment. Ray says which once the GCS knows (ActorDiedError, its node
                        # then no longer alive, so that a replacement cannot go there).
                        actor.done, actor.ask_at = None, now + _PENDING_LOOK
                        if not actor.unreachable:
                            actor.unreachable = True
                            log.info("node unreachable", node=node.node_id, reason=_why(exc))
                        continue
                    events.append(self._ended(node, NodeState.LOST, _why(exc)))
                    continue
                event = exit_event(node.node_id, code, who="the agent")
                events.append(self._ended(node, event.state, event.reason))
                self._kill(node)  # its agent ended: the actor has nothing left to do
            elif actor.ready is not None and now - actor.since > self.options.start_timeout:
                why = (
                    f"its actor did not start on Ray node {node.host} within "
                    f"{self.options.start_timeout:g}s (resources taken, or the node cannot "
                    "start it)"
                )
                events.append(self._ended(node, NodeState.FAILED, why))
                self._kill(node)
        return events

    def _ended(self, node: _RayNode, state: NodeState, reason: str) -> NodeEvent:
        _data(node).ready = None
        log.info("node ended", node=node.node_id, state=state.value, reason=reason)
        return NodeEvent(node_id=node.node_id, state=state, reason=reason)

    def wait(self, remaining: float) -> None:
        """Until a watched reference comes, at most ``remaining`` seconds; at most
        ``_PENDING_LOOK`` while a node waits for a free Ray node or is to be asked again."""
        watched = self.live()
        if any(n.waiting for n in self.nodes.values()) or any(
            _data(n).ask_at is not None for n in watched
        ):
            remaining = min(remaining, _PENDING_LOOK)
        refs = _refs(watched)
        if refs:
            cluster.import_ray().wait(refs, num_returns=1, timeout=remaining, fetch_local=False)
        else:
            time.sleep(remaining)

    def terminate(self, nodes: list[_RayNode], grace: float) -> None:
        """Stop the agents through their actors (SIGTERM, SIGKILL after ``grace``), then kill
        the actors. Those killed already are asked too: the answer (Ray's actor-died error)
        comes once the actor is gone, and with it its name, which a later node may take."""
        live = [n for n in nodes if n.data is not None and n.data.handle is not None]
        if not live:
            return
        ray = cluster.import_ray()
        stops = [_data(n).handle.stop.remote(grace) for n in live]
        try:
            ray.wait(stops, num_returns=len(stops), timeout=grace + _STOP_EXTRA)
        except Exception as exc:
            log.warning("stopping agents failed", error=str(exc))
        for node in live:
            self._kill(node)
            log.info("node stopped", node=node.node_id)

    def after_stop(self, nodes: list[_RayNode], everything: bool) -> None:
        """Stopping everything also ends a local cluster started for this run."""
        if everything and self._local is not None:
            cluster.import_ray().shutdown()
            self._local.shutdown()
            self._local = None

    def _kill(self, node: _RayNode) -> None:
        actor = _data(node)
        if actor.killed:
            return
        actor.killed = True
        try:
            cluster.import_ray().kill(actor.handle, no_restart=True)
        except Exception as exc:  # already gone with its node
            log.info("actor already gone", node=node.node_id, error=str(exc))


def _data(node: _RayNode) -> _Actor:
    assert node.data is not None, node.node_id
    return node.data


def _refs(nodes: list[_RayNode]) -> list[Any]:
    """The references still awaited of these nodes' actors."""
    return [r for n in nodes for r in (_data(n).ready, _data(n).done) if r is not None]


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
