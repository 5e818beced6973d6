"""The ``local`` scheduler: every node is an agent process on this machine.

Each node is one process running ``LaunchSpec.command`` in a session (and process group) of its
own; the node *is* that group. When the agent ends, whatever it left in its group is killed, as
if the machine had gone away, and :meth:`LocalScheduler.stop` signals the whole group.

Nodes get virtual host names (``local-0``, ``local-1``, ...) so that host exclusion can be
exercised on one machine: with ``hosts: 0`` every node has a host of its own, with ``hosts: N``
nodes cycle through N names and excluded names are skipped.

The nodes outlive the master. An agent whose master is gone keeps its workers training for
the job's ``master.grace`` and then stops them and exits by itself, so a master restarted on the
run directory (``planaria run --resume``) takes the nodes over (:meth:`LocalScheduler.adopt`):
it is not their parent, so it watches them through pidfds, cannot read their exit status, and
signals a node's group only while the node's process is the one it adopted (same pid, same start
time). Call :meth:`LocalScheduler.launch` and :meth:`LocalScheduler.replace` (the methods that
start processes) from one long-lived thread, as the master does with its single-thread
scheduler executor; a call from another thread raises :class:`~planaria.errors.SchedulerError`.
None of the methods is thread-safe, but
:meth:`~planaria.scheduler.api.Scheduler.interrupt`: a launch stops between two nodes when it
is called.

Size: every node and every worker is a process of this machine, so a job must fit it. It may
have at most ``max_nodes`` nodes (by default 4 per CPU), and as many workers as
:mod:`planaria.capacity` allows for this machine's CPUs and process table; this is checked when
the config loads, and the node count again at every launch. A fork storm is refused, not begun.

Why one module: it is one backend of :mod:`planaria.scheduler.engine`, and each part of it
(the options, placement on virtual hosts, starting a node in its namespace, reaping it through
a pidfd, adopting a running one by pid and start time) is about one thing, the node as a
process group of this machine; half of it is the options' and the capacity check's docs.

Network namespaces: with ``netns: [a, b, ...]`` node ``node-i`` (a replacement too: it gets
the next number) runs in namespace ``netns[i % len]`` through ``ip netns exec``, which needs
root. With the master in a namespace of its own and the namespaces joined by veth pairs on a
bridge (:mod:`planaria.testing.netns` makes such a network), every node talks to the master
and to its peers over a network that can really be cut: partitions rehearsed on one machine.
``/dev/shm`` stays shared (``ip netns exec`` makes a mount namespace of its own, but only
remounts ``/sys``), so flash checkpoints work as without namespaces. ``keep_replaced`` leaves a
replaced node running, unwatched, until the job ends, as a cluster scheduler that cannot reach
a partitioned machine must: what stops it then is the master's word when it hears from the
node again (fencing), not a signal from this machine.

Nodes are started, and their groups killed, through :mod:`planaria.process`; the pid the
scheduler watches is the agent's own. The agent ties the workers it starts to itself.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from planaria import process
from planaria.capacity import process_headroom, shortfall, usable_cpus
from planaria.durations import Duration
from planaria.errors import ConfigIssue, SchedulerError
from planaria.log import get_logger
from planaria.plugin import hookimpl
from planaria.scheduler.api import (
    LaunchSpec,
    NodeEvent,
    NodeHandle,
    NodeState,
    SchedulerRecord,
)
from planaria.scheduler.engine import EngineNode, EngineScheduler, Unplaceable, exit_event
from planaria.scheduler.logs import open_node_log as open_node_log  # its home before logs
from planaria.shm import node_dir, remove_dir

log = get_logger("scheduler.local")

# How often to look again for a node without a pidfd (old kernel): nothing can wake us.
_POLL_INTERVAL = 0.01

NODES_PER_CPU = 4
MIN_MAX_NODES = 8
# Besides its workers, a node runs its agent, the warm interpreter and the persister.
PROCESSES_PER_NODE = 3

NETNS_DIR = Path("/run/netns")
_NETNS_NAME = re.compile(r"[A-Za-z0-9._-]{1,255}")


class LocalOptions(BaseModel):
    """Options of the ``local`` scheduler."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hosts: int = Field(
        default=0,
        ge=0,
        description="number of virtual host names nodes cycle through (local-0, local-1, ...); "
        "0 gives every node a host of its own",
    )
    stop_grace: Duration = Field(
        default=5.0,
        description="time a node's processes get to exit after SIGTERM before SIGKILL",
    )
    slots: int = Field(
        default=0,
        ge=0,
        description="nodes this machine runs at once; more wait as pending, like a cluster "
        "with no free node (0: no limit)",
    )
    max_nodes: int | None = Field(
        default=None,
        ge=1,
        description=f"the most nodes a job may have at once on this machine, pending ones "
        f"included (default: {NODES_PER_CPU} per CPU, at least {MIN_MAX_NODES})",
    )

    keep_replaced: bool = Field(
        default=False,
        description="leave a replaced node's processes running (unwatched) until the job "
        "ends, as a cluster scheduler that cannot reach a partitioned machine leaves them: "
        "to rehearse fencing",
    )
    netns: list[str] = Field(
        default_factory=list,
        description="network namespaces the nodes run in, to rehearse partitions on one "
        "machine: node i (node-i, replacements included) runs in netns[i % len] through "
        "`ip netns exec` (needs root; each must exist)",
    )

    topology: dict[str, dict[str, str]] = Field(
        default_factory=dict,
        description="topology labels of the virtual hosts, put in each node's handle as a "
        "cluster's scheduler would: {local-0: {switch: s1}, local-1: {switch: s2}}; to "
        "rehearse a topology rank placement (rendezvous.backend: topology) on one machine",
    )

    @field_validator("topology")
    @classmethod
    def _topology_hosts(cls, hosts: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
        # A misspelled host would silently get no labels.
        wrong = [h for h in hosts if not re.fullmatch(r"local-(0|[1-9][0-9]*)", h)]
        if wrong:
            raise ValueError(
                f"{', '.join(map(repr, wrong))}: topology keys are the local scheduler's host "
                "names, local-0, local-1, ..."
            )
        return hosts

    @field_validator("netns")
    @classmethod
    def _netns_names(cls, names: list[str]) -> list[str]:
        for name in names:
            if not _NETNS_NAME.fullmatch(name) or name in (".", ".."):
                raise ValueError(
                    f"{name!r} is not a network namespace name: use letters, digits, '.', "
                    "'_' and '-' (the name of a file in /run/netns)"
                )
        return names

    @property
    def node_limit(self) -> int:
        return self.max_nodes or max(MIN_MAX_NODES, NODES_PER_CPU * usable_cpus())


def start_time(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, ``/proc/PID/stat`` field 22):
    with the pid, it names one process for good; None when there is no such process."""
    stat = process.proc_stat(pid)
    return None if stat is None or stat.exited else stat.start_time


class _Adopted:
    """A node process the master before this one started: not a child of this process, so
    its exit is seen (pidfd, /proc) but its status is unknown. What of ``subprocess.Popen``
    the scheduler uses."""

    def __init__(self, pid: int, started: str) -> None:
        self.pid = pid
        self.started = started
        self.returncode: int | None = None

    def exited(self) -> bool:
        if self.returncode is None and start_time(self.pid) != self.started:
            self.returncode = -signal.SIGKILL
        return self.returncode is not None

    def wait(self) -> int:
        while not self.exited():
            time.sleep(_POLL_INTERVAL)
        assert self.returncode is not None
        return self.returncode


@dataclass(eq=False)
class _Process:
    """A started node's agent process: the engine's data of a local node."""

    proc: subprocess.Popen[bytes] | _Adopted
    pidfd: int | None

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def reaped(self) -> bool:
        return self.proc.returncode is not None

    def close_pidfd(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None

    def collect(self) -> None:
        self.proc.wait()
        self.close_pidfd()

    def forget(self) -> None:
        """Stop watching a process that was reaped by someone else."""
        self.proc.returncode = -signal.SIGKILL
        self.close_pidfd()


_LocalNode = EngineNode[_Process]

_ADOPTED_EXIT = "exited; its status is unknown to a master that took the node over"


def _open_pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # not Linux, or a kernel older than 5.3
        return None


class _ReapedElsewhere(Exception):
    """Our child was reaped by someone else (a ``waitpid(-1)`` elsewhere in this process, or
    SIGCHLD set to SIG_IGN): its exit status is lost and its pid may already be reused."""


def _has_exited(pid: int) -> bool:
    """Whether our child ``pid`` has exited, without reaping it: while it is an unreaped zombie
    its pid, which is also its process group's id, cannot be reused, so the group can still be
    signalled safely."""
    try:
        return process.has_exited(pid)
    except ChildProcessError:
        raise _ReapedElsewhere from None


class LocalScheduler(EngineScheduler[LocalOptions, _Process]):
    """Nodes are agent processes on this machine (see the module docstring). The engine
    (:mod:`planaria.scheduler.engine`) keeps the nodes, their events and the excluded hosts;
    this class places nodes on virtual hosts and slots, and starts, watches and kills their
    processes."""

    name = "local"
    nodes_here = True
    owner_thread = "its nodes die when the thread that started them exits (PR_SET_PDEATHSIG)"

    @classmethod
    def capacity_issues(
        cls, options: LocalOptions, *, nodes: int, procs_per_node: int
    ) -> list[ConfigIssue]:
        """Every node and every worker is a process of this machine: the job must fit it."""
        limit = options.node_limit
        if nodes > limit:
            default = "" if options.max_nodes else f" (by default {NODES_PER_CPU} per CPU)"
            return [
                ConfigIssue(
                    "job.nodes",
                    f"{nodes} nodes are more than the local scheduler runs on this machine: at "
                    f"most {limit}, its option max_nodes{default}; ask for fewer nodes, or set "
                    "scheduler.options.max_nodes if this machine can take them",
                )
            ]
        workers = nodes * procs_per_node
        why = shortfall(workers, nodes * (procs_per_node + PROCESSES_PER_NODE))
        if why is None:
            return []
        return [
            ConfigIssue(
                "job.procs_per_node" if procs_per_node > 1 else "job.nodes",
                f"{nodes} node(s) x {procs_per_node} worker(s) all run on this machine, and {why}; "
                "ask for fewer nodes or workers per node",
            )
        ]

    def __init__(self, options: LocalOptions) -> None:
        super().__init__(options)
        self._cursor = 0

    # -- the Scheduler interface, beyond the engine's ------------------------------------

    def adopt(self, spec: LaunchSpec, handles: list[NodeHandle], excluded: set[str]) -> None:
        """Take over the nodes a master before this one started (the module docstring says
        how they are watched); those that have ended meanwhile are reported lost."""
        self.check_thread()
        self.keep_excluded(excluded)
        for handle in handles:
            pid, started = handle.data.get("pid", ""), handle.data.get("start", "")
            if not pid.isdigit() or not started:  # it was waiting for a slot: it still does
                self.add_adopted(handle, spec, None)
                continue
            proc = _Adopted(int(pid), started)
            node = self.add_adopted(handle, spec, _Process(proc, None))
            if handle.state is NodeState.LOST or proc.exited():
                proc.returncode = proc.returncode or -signal.SIGKILL
                # Said only of one that ended while no master watched (a lost one is quiet).
                self.report(node, NodeState.LOST, _ADOPTED_EXIT)
                continue
            assert node.data is not None
            node.data.pidfd = _open_pidfd(proc.pid)
            if not proc.exited():  # the pidfd names the process we checked
                log.info("node adopted", node=node.node_id, host=node.host, pid=proc.pid)
                continue
            node.data.close_pidfd()
            self.report(node, NodeState.LOST, _ADOPTED_EXIT)

    def node_addresses(self) -> list[str]:
        """``127.0.0.1``: the nodes run on this machine; with ``netns``, the addresses in
        those namespaces (their interfaces' global ones), which the master reaches over
        whatever joins them to its own."""
        if not self.options.netns:
            return ["127.0.0.1"]
        return [a for name in self.options.netns for a in _netns_addresses(name)]

    # -- checks -----------------------------------------------------------------------------

    def check_spec(self, spec: LaunchSpec) -> None:
        super().check_spec(spec)
        path = {**os.environ, **spec.env}.get("PATH", os.defpath)
        if shutil.which(spec.command[0], path=path) is None:
            raise SchedulerError(
                f"cannot launch nodes: {spec.command[0]!r} is not an executable file"
                + ("" if os.sep in spec.command[0] else " found on PATH")
            )
        if self.options.netns:
            self._check_netns(path)

    def _check_netns(self, path: str) -> None:
        """Nodes run through ``ip netns exec``: it must be there, and so must every
        namespace, and entering one needs root."""
        why = "cannot launch nodes in network namespaces (scheduler.options.netns)"
        if shutil.which("ip", path=path) is None:
            raise SchedulerError(f"{why}: the `ip` command (iproute2) is not on PATH")
        if os.geteuid() != 0:
            raise SchedulerError(f"{why}: entering a network namespace needs root")
        missing = [name for name in self.options.netns if not (NETNS_DIR / name).exists()]
        if missing:
            raise SchedulerError(
                f"{why}: no network namespace {', '.join(map(repr, missing))} "
                f"(not in {NETNS_DIR}); create it with `ip netns add {missing[0]}` and link it "
                "to the master's network (a veth pair), or remove it from the list"
            )

    def check_room(self, count: int) -> None:
        """The job's size was checked when its config loaded; this holds for every caller."""
        limit = self.options.node_limit
        have = sum(1 for n in self.nodes.values() if not n.released)
        if have + count > limit:
            raise SchedulerError(
                f"cannot launch {count} more node(s) beside {have}: the local scheduler runs "
                f"at most {limit} on this machine (its option max_nodes)"
            )
        headroom = process_headroom()
        if headroom is not None and count * PROCESSES_PER_NODE > headroom[0]:
            raise SchedulerError(
                f"cannot launch {count} node(s): this machine's process table has room for "
                f"{headroom[0]} more processes ({headroom[1]})"
            )

    # -- placement ------------------------------------------------------------------------

    def place(
        self, node: _LocalNode, avoid: frozenset[str], replacing: _LocalNode | None
    ) -> str | None:
        """A virtual host (the node's own with ``hosts: 0``, else the next one not avoided),
        once a slot is free."""
        hosts = self._hosts()
        if hosts and all(host in avoid for host in hosts):
            raise Unplaceable(
                f"all {len(hosts)} local host(s) are excluded "
                f"({', '.join(sorted(avoid & set(hosts)))}); raise the local scheduler's "
                "`hosts` option to have more virtual hosts"
            )
        running = sum(
            1
            for n in self.nodes.values()
            if n.data is not None and not n.released and not n.data.reaped and n is not replacing
        )
        if self.options.slots and running >= self.options.slots:
            return None
        if not hosts:
            # One host per node, named like it: never an excluded one.
            return node.node_id.replace("node-", "local-", 1)
        while True:
            host = hosts[self._cursor % len(hosts)]
            self._cursor += 1
            if host not in avoid:
                return host

    def _hosts(self) -> list[str]:
        return [f"local-{i}" for i in range(self.options.hosts)]

    # -- processes ------------------------------------------------------------------------

    def _command(self, spec: LaunchSpec, node_id: str) -> tuple[str, ...]:
        """The node's command; in its network namespace when ``netns`` is set. ``ip netns
        exec`` execs the command in the same process (no fork), so the pid, the process
        group and the death signal set before the exec stay the node's own."""
        names = self.options.netns
        if not names:
            return spec.command
        netns = names[int(node_id.rsplit("-", 1)[1]) % len(names)]
        if not (NETNS_DIR / netns).exists():  # removed since the launch was checked
            raise SchedulerError(
                f"cannot start {node_id} in network namespace {netns!r}: it no longer exists "
                f"(not in {NETNS_DIR}); create it with `ip netns add {netns}`"
            )
        return ("ip", "netns", "exec", netns, *spec.command)

    def start(self, node: _LocalNode) -> _Process:
        spec, node_id, host = node.spec, node.node_id, node.host
        env = {**os.environ, **spec.env, "PLANARIA_NODE_ID": node_id, "PLANARIA_HOST": host}
        try:
            log_fd = None if spec.log_dir is None else open_node_log(spec.log_dir, node_id)
        except OSError as exc:
            raise SchedulerError(
                f"cannot open the log of {node_id} in {spec.log_dir}: {exc}"
            ) from exc
        try:
            proc = process.popen(
                self._command(spec, node_id),
                die_with_parent=not spec.detached,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log_fd,
                stderr=log_fd,
            )
        except OSError as exc:
            raise SchedulerError(f"cannot start {node_id} ({spec.command[0]}): {exc}") from exc
        finally:
            if log_fd is not None:
                os.close(log_fd)
        # A local process runs as soon as it exists: the next poll reports it running.
        self.report(node, NodeState.RUNNING)
        log.info("node started", node=node_id, host=host, pid=proc.pid)
        return _Process(proc, _open_pidfd(proc.pid))

    def handle_data(self, node: _LocalNode) -> dict[str, str]:
        """The pid and its start time: they name the process for good (:meth:`adopt`)."""
        assert node.data is not None
        return {"pid": str(node.data.pid), "start": start_time(node.data.pid) or ""}

    def handle_topology(self, node: _LocalNode) -> dict[str, str]:
        """The ``topology`` option's labels of the node's host."""
        return dict(self.options.topology.get(node.host, {}))

    def observe(self) -> list[NodeEvent]:
        """Every exit of a watched node, as an event."""
        events = []
        for node in self.nodes.values():
            proc = node.data
            if proc is None or node.released or proc.reaped:
                continue
            if isinstance(proc.proc, _Adopted):
                if not proc.proc.exited():
                    continue
                process.signal_group(proc.pid, signal.SIGKILL)  # its workers, if any are left
                proc.collect()
                event = NodeEvent(node_id=node.node_id, state=NodeState.LOST, reason=_ADOPTED_EXIT)
            else:
                try:
                    if not _has_exited(proc.pid):
                        continue
                except _ReapedElsewhere:
                    proc.forget()
                    event = NodeEvent(
                        node_id=node.node_id,
                        state=NodeState.LOST,
                        reason="exit status unknown: the process was reaped outside the scheduler",
                    )
                else:
                    # The agent is gone but not yet reaped, so its group id is still its own:
                    # whatever the agent left in its group goes with it, as with a lost machine.
                    process.signal_group(proc.pid, signal.SIGKILL)
                    proc.collect()
                    assert proc.proc.returncode is not None
                    event = exit_event(node.node_id, proc.proc.returncode)
            events.append(event)
            # How its agent ended: exit 0 is no verdict on the job, which may have failed.
            log.info("node's agent exited", node=node.node_id, how=event.reason or "exit code 0")
        return events

    def wait(self, remaining: float) -> None:
        """Sleep until a watched node may have exited, at most ``remaining`` seconds."""
        live = [
            n.data for n in self.nodes.values() if n.data and not n.released and not n.data.reaped
        ]
        fds = [p.pidfd for p in live if p.pidfd is not None]
        if len(fds) < len(live):
            remaining = min(remaining, _POLL_INTERVAL)
        process.wait_readable(fds, remaining)

    def retire(self, node: _LocalNode) -> None:
        if self.options.keep_replaced:
            assert node.data is not None
            log.info(
                "replaced node left running (keep_replaced)", node=node.node_id, pid=node.data.pid
            )
        else:
            super().retire(node)

    def terminate(self, nodes: list[_LocalNode], grace: float) -> None:
        """SIGTERM the groups, SIGKILL them after ``grace``, wait until no process of the groups
        is left, then reap the agents. Only groups whose agent is still unreaped are
        signalled: their id cannot belong to anyone else."""
        procs = {n.node_id: n.data for n in nodes if n.data is not None and not n.data.reaped}
        for node_id, proc in list(procs.items()):
            if isinstance(proc.proc, _Adopted):
                if proc.proc.exited():  # its pid may be someone else's by now
                    proc.close_pidfd()
                    del procs[node_id]
                continue
            try:
                _has_exited(proc.pid)
            except _ReapedElsewhere:  # its pid may be someone else's by now: never signal it
                proc.forget()
                del procs[node_id]
        if not procs:
            return
        left = process.kill_groups({p.pid for p in procs.values()}, grace)
        # Only now are the agents reaped: until then their group ids could not be reused.
        for node_id, proc in procs.items():
            proc.collect()
            log.info("node stopped", node=node_id, returncode=proc.proc.returncode)
        if left:
            log.warning(
                "processes of stopped nodes survived SIGKILL",
                nodes=[i for i, p in procs.items() if p.pid in left],
            )

    def after_stop(self, nodes: list[_LocalNode], everything: bool) -> None:
        """These nodes share this machine's /dev/shm: whatever an agent killed without a
        chance to clean up (and its persister) left there goes with the job."""
        if everything:
            for node in nodes:
                if node.started and node.spec.run_id:
                    remove_dir(node_dir(node.spec.run_id, node.node_id))


@hookimpl
def planaria_schedulers() -> Iterable[SchedulerRecord]:
    yield SchedulerRecord(
        name="local",
        factory=LocalScheduler,
        options=LocalOptions,
        summary="nodes are agent processes on this machine",
    )


def _netns_addresses(name: str) -> list[str]:
    """The global addresses of network namespace ``name``'s interfaces (``ip -n``); none when
    it cannot be read (it is gone, or this user may not enter it)."""
    try:
        done = subprocess.run(
            ["ip", "-n", name, "-o", "addr", "show", "scope", "global"],
            capture_output=True, text=True, timeout=10, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("cannot read a network namespace's addresses", netns=name, error=str(exc))
        return []
    if done.returncode != 0:
        log.warning(
            "cannot read a network namespace's addresses", netns=name, error=done.stderr.strip()
        )
        return []
    words = done.stdout.split()
    return [
        words[i + 1].split("/")[0] for i, word in enumerate(words[:-1]) if word in ("inet", "inet6")
    ]
