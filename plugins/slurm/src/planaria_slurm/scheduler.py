"""The ``slurm`` scheduler: inside an allocation, one agent per node, each its own job step.

Every node is ``srun --jobid=J --nodes=1 --ntasks=1 --nodelist=<node> --overlap
--kill-on-bad-exit=0 --export=ALL <agent>``, started here: the loss of one node ends one step,
never the job (the allocation must survive a down node: ``sbatch --no-kill``, which ``planaria
submit`` writes). The srun's exit is the node's exit, seen at once through a pidfd; what Slurm
says about the nodes (``sinfo``) and the steps (``squeue -s``) comes from a watcher thread
(:mod:`planaria_slurm.watch`), so :meth:`SlurmScheduler.poll` never waits on a Slurm command.
A node Slurm reports down, drained or not responding has its step cancelled and is reported
``lost``; this job uses it no more.

The allocation's nodes beyond the job's are spares: a replacement goes to a free spare first,
and back to the old node only when that node is sound. The job token reaches the agents only
through the environment (srun exports it), never a command line.

The scheduler engine (:mod:`planaria.scheduler.engine`) keeps the nodes, their ids and
events, the excluded hosts and the one-thread rule; this module places nodes on the
allocation's hosts and starts, watches and stops their steps. Each node's handle carries
its host's leaf switch (or block) from Slurm's topology plugin, read once per allocation
(:func:`planaria_slurm.commands.node_topology`), for a topology rank placement.

Why one module: it is one backend of the engine, and the step's life (placed on a host of the
allocation, started, watched, stopped) is one idea; the Slurm facts it relies on (what a
down node does to a step, what srun's exit says) are stated where they are used, which
splitting would scatter.
Submission is in :mod:`planaria_slurm.submit`, and the nodes remembered bad in
:mod:`planaria_slurm.state`.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

from planaria import process
from planaria.errors import ConfigIssue
from planaria.log import get_logger
from planaria.plugin import (
    EngineNode,
    EngineScheduler,
    NodeEvent,
    NodeState,
    SchedulerError,
    SubmitRequest,
    SubmitResult,
    Unplaceable,
    exit_event,
)
from planaria.protocol import HOST_ENV, NODE_ID_ENV
from planaria_slurm import commands, state, submit
from planaria_slurm.commands import NodeStatus
from planaria_slurm.options import SlurmOptions
from planaria_slurm.watch import Snapshot, Watcher

log = get_logger("scheduler.slurm")

# After SIGKILL of a step, srun reports its end within a second; past this it is stuck
# (slurmctld gone) and is killed here.
_SRUN_KILL_WAIT = 15.0
_CLEANUP_TIMEOUT = 60.0


@dataclass(eq=False)
class _Step:
    """A started node's job step: the engine's data of a Slurm node."""

    name: str
    """The step's name (srun --job-name), by which squeue shows its id."""
    proc: subprocess.Popen[bytes]
    pidfd: int | None
    step_id: str | None = None
    exited: float | None = None
    """When its srun was seen to end, while the report waits for Slurm's next word on the
    node: srun exits 0 on "Node failure", so its status alone cannot tell a loss."""

    @property
    def reaped(self) -> bool:
        return self.proc.returncode is not None


_SlurmNode = EngineNode[_Step]


def allocation(options: SlurmOptions) -> str | None:
    """The job id of the allocation to use: the option, or the one this process runs in."""
    return options.job_id or os.environ.get("SLURM_JOB_ID") or None


def allocation_addresses(job_id: str | None) -> list[str]:
    """The addresses of allocation ``job_id``'s nodes (:func:`commands.node_addresses`); none
    when there is no allocation or Slurm cannot say (it is logged)."""
    if job_id is None:
        return []
    try:
        return commands.node_addresses(commands.job_nodes(job_id))
    except SchedulerError as exc:
        log.warning("cannot read the allocation's node addresses", job=job_id, error=str(exc))
        return []


def _scancel(step_ids: list[str], sig: signal.Signals) -> list[str]:
    """The command that sends ``sig`` to every process of the steps, on their nodes."""
    return ["scancel", f"--signal={sig.name[3:]}", *step_ids]


def _run_scancel(step_ids: list[str], sig: signal.Signals) -> None:
    try:
        commands.run(_scancel(step_ids, sig), check=False)
    except SchedulerError as exc:
        log.warning("scancel failed", error=str(exc))


class SlurmScheduler(EngineScheduler[SlurmOptions, _Step]):
    """Nodes are job steps of a Slurm allocation (see the module docstring)."""

    name = "slurm"
    nodes_here = False
    owner_thread = (
        "each srun dies with the thread that started it (PR_SET_PDEATHSIG), and its step with it"
    )

    @classmethod
    def capacity_issues(
        cls, options: SlurmOptions, *, nodes: int, procs_per_node: int
    ) -> list[ConfigIssue]:
        """Slurm must be installed; a named partition must exist; inside an allocation the
        job must fit it."""
        if not commands.installed():
            return [
                ConfigIssue(
                    "scheduler.backend",
                    "Slurm's commands (srun, squeue, sbatch) are not installed here, or not on "
                    "PATH: run planaria on a machine of the Slurm cluster",
                )
            ]
        issues = []
        try:
            if options.partition is not None:
                found = commands.run(["sinfo", "-h", "-p", options.partition, "-o", "%P"])
                if not found.strip():
                    issues.append(
                        ConfigIssue(
                            "scheduler.options.partition",
                            f"Slurm has no partition {options.partition!r} (sinfo -p shows "
                            "nothing); `sinfo -s` lists them",
                        )
                    )
            job_id = allocation(options)
            if job_id is not None and options.job_id is not None:
                have = commands.job_nodes(job_id)
                if len(have) < nodes:
                    issues.append(
                        ConfigIssue(
                            "job.nodes",
                            f"the job wants up to {nodes} nodes, but Slurm job {job_id} has "
                            f"{len(have)} ({', '.join(have)}): ask for fewer, or allocate more",
                        )
                    )
        except commands.SlurmCommandError as exc:
            issues.append(ConfigIssue("scheduler.options", str(exc)))
        return issues

    @classmethod
    def submit(
        cls, options: SlurmOptions, request: SubmitRequest, *, dry_run: bool
    ) -> SubmitResult:
        return submit.submit(options, request, dry_run=dry_run)

    def __init__(self, options: SlurmOptions) -> None:
        super().__init__(options)
        self._tag = uuid.uuid4().hex[:8]
        self._job_id: str | None = None
        self._pool: list[str] = []
        self._watcher: Watcher | None = None
        self._states: dict[str, NodeStatus] = {}
        """What Slurm said of the nodes when the current launch began: it places them all."""
        self._background: list[subprocess.Popen[Any]] = []
        self._used: dict[str, set[str]] = {}
        """Host -> the (run id, node id) ... of every node that ran there: cleaned at stop."""
        self._topology: dict[str, dict[str, str]] = {}
        """Host -> its topology labels (``switch``, ``block``), read once for the allocation."""

    def node_addresses(self) -> list[str]:
        """Where Slurm reaches the allocation's nodes (their ``NodeAddr``); none outside an
        allocation, or when Slurm cannot say."""
        return allocation_addresses(allocation(self.options))

    # -- the allocation -----------------------------------------------------------------

    def check_room(self, count: int) -> None:
        """Find the allocation (once), and ask Slurm once for the whole launch which of its
        nodes are sound: too few free ones refuse the launch before any step starts."""
        self._attach()
        self._states = self._node_states()
        free = self._free_hosts(frozenset(self.excluded_hosts()), self._states)
        if len(free) < count:
            raise SchedulerError(self._shortage(count, len(free)))

    def _attach(self) -> None:
        """Find the allocation and its nodes, once."""
        if self._job_id is not None:
            if self._watcher is None:
                self._watch()
            return
        job_id = allocation(self.options)
        if job_id is None:
            raise SchedulerError(
                "not inside a Slurm allocation (SLURM_JOB_ID is not set and "
                "scheduler.options.job_id is not given): run `planaria submit job.yaml`, or "
                "`planaria run` inside sbatch or salloc"
            )
        self._pool = commands.job_nodes(job_id)
        self._job_id = job_id
        self._topology = self._read_topology()
        for host, why in state.load(self.options.state_dir).items():
            if host in self._pool:
                # Remembered (and drained, with `drain`) by that run: not reported again.
                self.keep_excluded([host], why)
                log.warning("node excluded: found bad by an earlier run", host=host, why=why)
        self._watch()

    def _read_topology(self) -> dict[str, dict[str, str]]:
        """Where the topology plugin puts the allocation's nodes (their leaf switch or
        block), asked once: a node's place in the network does not change while the
        allocation holds it. A Slurm that cannot say costs the labels, not the job."""
        try:
            labels = commands.node_topology(self._pool)
        except SchedulerError as exc:
            log.warning("cannot read the cluster's topology; nodes get no labels", error=str(exc))
            return {}
        if labels:
            log.info("topology read", nodes=len(labels))
        return labels

    def handle_topology(self, node: _SlurmNode) -> dict[str, str]:
        """The node's host's labels from Slurm's topology plugin (``{"switch": "s1"}``);
        none without one."""
        return dict(self._topology.get(node.host, {}))

    def _watch(self) -> None:
        assert self._job_id is not None
        self._watcher = Watcher(
            self._job_id,
            self._pool,
            self.options.watch_interval,
            eager=lambda: (
                any(n.data.step_id is None for n in self._unreaped() if n.data)
                or bool(self._pending())
            ),
        )

    def _bad_hosts(self) -> dict[str, str]:
        """Hosts of the allocation Slurm now reports unusable, with why."""
        if self._watcher is None:
            return {}
        nodes = self._watcher.snapshot.nodes
        return {h: nodes[h].describe() for h in self._pool if h in nodes and not nodes[h].usable}

    def _node_states(self) -> dict[str, NodeStatus]:
        """What Slurm says of the allocation's nodes now; the watcher's last look when Slurm
        cannot be asked."""
        try:
            return commands.node_states(self._pool)
        except SchedulerError as exc:
            log.warning("cannot read node states; trusting the last ones", error=str(exc))
            return self._watcher.snapshot.nodes if self._watcher else {}

    def _free_hosts(self, avoid: frozenset[str], states: dict[str, NodeStatus]) -> list[str]:
        """Nodes that no node of ours holds (one that ended holds its node until it is
        stopped or replaced), outside ``avoid``, and sound as far as Slurm says."""
        taken = {n.host for n in self.nodes.values() if n.host and not n.released} | avoid
        return [h for h in self._pool if h not in taken and self._sound(h, states)]

    def _sound(self, host: str, states: dict[str, NodeStatus]) -> bool:
        """Not excluded, and usable as far as Slurm says."""
        return host not in self.excluded_hosts() and (host not in states or states[host].usable)

    def _shortage(self, count: int, free: int) -> str:
        excluded = ", ".join(f"{h} ({why})" for h, why in sorted(self.exclusions().items()))
        return (
            f"cannot launch {count} node(s): Slurm job {self._job_id} has {len(self._pool)} "
            f"node(s) ({', '.join(self._pool)}), of which {free} are free and sound"
            + (f"; excluded: {excluded}" if excluded else "")
            + ": allocate more nodes, or ask for fewer (job.nodes)"
        )

    def place(self, node: _SlurmNode, avoid: frozenset[str], replacing: _SlurmNode | None) -> str:
        """A free, sound node of the allocation outside ``avoid``; for a replacement a free
        spare first, else the old node when it is sound and not excluded. The old node's host
        is excluded here when Slurm reports it bad or the caller asked: before a requeue,
        which must leave it out. No node to go to: :class:`Unplaceable`, after requeueing
        the batch job with the ``requeue`` option."""
        if replacing is None:
            states = self._states  # the launch's one look (check_room)
        else:
            old = replacing
            bad = self._bad_hosts().get(old.host)
            if bad is not None:
                self.exclude(old.host, bad)
            elif old.host in avoid:
                self.exclude(old.host, f"node {old.node_id} was diagnosed faulty")
            states = self._node_states()
        free = self._free_hosts(avoid, states)
        if free:
            return free[0]
        if replacing is not None and self._sound(replacing.host, states):
            return replacing.host
        message = (
            f"no spare node is left in Slurm job {self._job_id} (nodes {', '.join(self._pool)}; "
            f"excluded: {', '.join(sorted(self.excluded_hosts())) or 'none'})"
        )
        if replacing is not None and self.options.requeue:
            message += "; " + self._requeue()
        raise Unplaceable(message)

    def on_exclude(self, host: str, why: str) -> None:
        """Remember the node bad, for later submissions of the job; with ``drain``, drain it,
        so that no other job lands on it either."""
        state.remember(self.options.state_dir, host, why)
        if self.options.drain:
            try:
                commands.run(
                    [
                        "scontrol",
                        "update",
                        f"nodename={host}",
                        "state=drain",
                        f"reason=planaria: {why}"[:200],
                    ]
                )
            except SchedulerError as exc:
                log.warning(
                    "cannot drain the node (operator rights needed?)", host=host, error=str(exc)
                )

    def _requeue(self) -> str:
        """Requeue the batch job without the excluded nodes; says what was done."""
        job_id = self._job_id
        assert job_id is not None
        exclude = ",".join(sorted(self.excluded_hosts()))
        update = ["scontrol", "update", f"jobid={job_id}", f"ExcNodeList={exclude}"]
        try:
            commands.run(["scontrol", "requeue", job_id])
        except SchedulerError as exc:
            return f"requeueing it failed: {exc}"
        if exclude:
            # A running job's ExcNodeList cannot change; a requeued one is pending again.
            deadline = time.monotonic() + 10.0
            while True:
                try:
                    commands.run(update)
                    break
                except SchedulerError as exc:
                    if time.monotonic() > deadline:
                        log.warning(
                            "cannot exclude the bad nodes from the requeued job", error=str(exc)
                        )
                        break
                    time.sleep(0.5)
        log.warning("job requeued", job=job_id, excluded=exclude)
        return f"Slurm job {job_id} requeued" + (f" without {exclude}" if exclude else "")

    # -- steps ----------------------------------------------------------------------------

    def start(self, node: _SlurmNode) -> _Step:
        assert self._job_id is not None and self._watcher is not None
        spec, node_id, host = node.spec, node.node_id, node.host
        name = f"planaria.{spec.run_id or self._tag}.{node_id}"
        env = {**os.environ, **spec.env, NODE_ID_ENV: node_id, HOST_ENV: host}
        argv = [
            "srun",
            f"--jobid={self._job_id}",
            "--nodes=1",
            "--ntasks=1",
            f"--nodelist={host}",
            "--overlap",
            "--kill-on-bad-exit=0",
            "--export=ALL",
            f"--job-name={name}",
            # Around the agent, so that no process of the node outlives its step.
            sys.executable,
            "-m",
            "planaria_slurm.step",
            *spec.command,
        ]
        try:
            log_fd = None if spec.log_dir is None else state.open_log(spec.log_dir, node_id)
        except OSError as exc:
            raise SchedulerError(
                f"cannot open the log of {node_id} in {spec.log_dir}: {exc}"
            ) from exc
        try:
            proc = process.popen(
                argv, env=env, stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd
            )
        except OSError as exc:
            raise SchedulerError(f"cannot start srun for {node_id}: {exc}") from exc
        finally:
            if log_fd is not None:
                os.close(log_fd)
        try:
            pidfd: int | None = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):
            pidfd = None
        if spec.run_id:
            self._used.setdefault(host, set()).add(f"{spec.run_id}\0{node_id}")
        self._watcher.nudge()
        log.info("node started", node=node_id, host=host, step_name=name)
        return _Step(name, proc, pidfd)

    def _unreaped(self) -> list[_SlurmNode]:
        """Started nodes the caller holds whose srun is not reaped yet."""
        return [
            n
            for n in list(self.nodes.values())
            if n.data is not None and not n.released and not n.data.reaped
        ]

    def _pending(self) -> list[_SlurmNode]:
        """Nodes whose srun ended, not reported yet."""
        return [
            n
            for n in list(self.nodes.values())
            if n.data is not None and n.data.exited is not None and not n.ended and not n.released
        ]

    def observe(self) -> list[NodeEvent]:
        """Reap the sruns that ended, then act on the watcher's latest look: steps that
        appeared run; a node gone bad loses its step; an ended srun is reported once Slurm
        has looked at its node since."""
        self._reap()
        events: list[NodeEvent] = []
        if self._watcher is not None:
            self._watcher.drain_wake()
        snapshot = self._watcher.snapshot if self._watcher is not None else Snapshot()
        bad = self._bad_hosts()
        for node in self._unreaped():
            step = node.data
            assert step is not None
            if node.ended:
                continue
            if step.step_id is None and step.name in snapshot.steps:
                step.step_id = snapshot.steps[step.name]
                events.append(NodeEvent(node_id=node.node_id, state=NodeState.RUNNING))
            why = bad.get(node.host)
            if why is not None:
                events.append(NodeEvent(node_id=node.node_id, state=NodeState.LOST, reason=why))
                log.warning("node lost", node=node.node_id, why=why)
                self._signal([step], signal.SIGKILL, wait=False)
        now = time.monotonic()
        late = max(5.0, 3 * self.options.watch_interval)
        for node in self._pending():
            step = node.data
            assert step is not None and step.exited is not None
            why = bad.get(node.host)
            if why is None and snapshot.taken <= step.exited and now - step.exited < late:
                continue  # Slurm's look at the node since the exit is still to come
            if why is not None:
                event = NodeEvent(node_id=node.node_id, state=NodeState.LOST, reason=why)
            else:
                assert step.proc.returncode is not None
                event = exit_event(node.node_id, step.proc.returncode, who="srun", shell=True)
            events.append(event)
            # How its agent ended: exit 0 is no verdict on the job, which may have failed.
            log.info("node's agent exited", node=node.node_id, how=event.reason or "exit code 0")
        return events

    def _reap(self) -> None:
        for node in self._unreaped():
            step = node.data
            assert step is not None
            try:
                if not process.has_exited(step.proc.pid):
                    continue
            except ChildProcessError:  # reaped elsewhere: its status is lost
                step.proc.returncode = -signal.SIGKILL
            self._close(step)
            if not node.ended:
                step.exited = time.monotonic()
                if self._watcher is not None:
                    self._watcher.nudge()
                else:
                    step.exited = -math.inf  # nobody to ask: report at once

    def _close(self, step: _Step) -> None:
        """Reap the srun; whatever it left in its group goes first (its group id is still its
        own while it is unreaped)."""
        if step.proc.returncode is None:
            process.signal_group(step.proc.pid, signal.SIGKILL)
            step.proc.wait()
        if step.pidfd is not None:
            os.close(step.pidfd)
            step.pidfd = None

    def wait(self, remaining: float) -> None:
        """Sleep until an srun may have ended or the watcher has news, at most
        ``remaining`` seconds."""
        steps = [n.data for n in self._unreaped() if n.data is not None]
        fds = [s.pidfd for s in steps if s.pidfd is not None]
        if len(fds) < len(steps):
            remaining = min(remaining, 0.01)
        if self._watcher is not None:
            fds.append(self._watcher.wake_fd)
        process.wait_readable(fds, remaining)

    def _signal(self, steps: list[_Step], sig: signal.Signals, *, wait: bool) -> None:
        """Signal the steps through Slurm (every process of the step, on its node), or, for
        one whose step id is not known yet, its srun (which passes SIGTERM on, and takes its
        step down when killed)."""
        known = [s for s in steps if s.step_id is not None]
        if known:
            ids = [str(s.step_id) for s in known]
            if wait:
                _run_scancel(ids, sig)
            else:
                self._background = [p for p in self._background if p.poll() is None]
                self._background.append(
                    process.popen(
                        _scancel(ids, sig),
                        die_with_parent=False,
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                )
        for step in steps:
            if step.step_id is None and not step.reaped:
                process.signal_group(step.proc.pid, sig)

    def terminate(self, nodes: list[_SlurmNode], grace: float) -> None:
        """SIGTERM the steps, SIGKILL them after ``grace``, and return when their sruns have
        ended and Slurm shows none of the steps any more."""
        steps = {n.node_id: n.data for n in nodes if n.data is not None}
        live = [s for s in steps.values() if not s.reaped]
        if not live:
            return
        self._find_ids(live)
        if grace > 0:
            self._signal(live, signal.SIGTERM, wait=True)
            live = self._wait_exit(live, grace)
        if live:
            self._find_ids(live)
            self._signal(live, signal.SIGKILL, wait=True)
            live = self._wait_exit(live, _SRUN_KILL_WAIT)
        for step in live:  # srun stuck (slurmctld gone): end it here
            process.kill_group(step.proc.pid, 0.0)
        for node_id, step in steps.items():
            if not step.reaped:
                self._close(step)
            log.info("node stopped", node=node_id, returncode=step.proc.returncode)
        self._wait_steps_gone({s.name for s in steps.values()})

    def _find_ids(self, steps: list[_Step]) -> None:
        if all(s.step_id is not None for s in steps) or self._job_id is None:
            return
        try:
            ids = commands.job_steps(self._job_id)
        except SchedulerError as exc:
            log.warning("cannot list the job's steps", error=str(exc))
            return
        for step in steps:
            step.step_id = step.step_id or ids.get(step.name)

    def _wait_exit(self, steps: list[_Step], timeout: float) -> list[_Step]:
        """Wait until the sruns have exited, at most ``timeout``; the ones still running."""
        deadline = time.monotonic() + timeout
        while True:
            left = [s for s in steps if s.proc.poll() is None]
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(0.02)

    def _wait_steps_gone(self, names: set[str], timeout: float = 10.0) -> None:
        """A step leaves squeue a moment after its srun ends: wait for that, so that a stop
        that returned left nothing of the job running. A step still listed a second on is
        sent SIGKILL again: a signal that reached its node before the step's tasks were
        started (a busy node) was lost, and the tasks would run on."""
        if self._job_id is None:
            return
        deadline = time.monotonic() + timeout
        again = time.monotonic() + 1.0
        while True:
            try:
                steps = commands.job_steps(self._job_id)
            except SchedulerError:
                return
            left = [steps[name] for name in names & steps.keys()]
            now = time.monotonic()
            if not left or now >= deadline:
                return
            if now >= again:
                again = now + 1.0
                _run_scancel(left, signal.SIGKILL)
            time.sleep(0.1)

    def after_stop(self, nodes: list[_SlurmNode], everything: bool) -> None:
        """When the job ends: remove what its nodes left in their /dev/shm (a cleanup step
        per node used), end the watcher thread, and wait for the scancels still running."""
        if not everything:
            return
        self._cleanup_shm()
        if self._watcher is not None:
            self._watcher.close()
            self._watcher = None
        for proc in self._background:
            proc.wait()
        self._background.clear()

    def _cleanup_shm(self) -> None:
        """Run ``planaria_slurm.cleanup`` on every sound node the job used: agents killed
        without a chance to clean up leave their shared memory behind, and a node's /dev/shm
        is only reachable from the node."""
        used, self._used = self._used, {}
        if self._job_id is None or not used:
            return
        bad = self._bad_hosts()
        procs = []
        for host, pairs in sorted(used.items()):
            if host in bad:
                continue
            argv = [
                "srun",
                f"--jobid={self._job_id}",
                "--nodes=1",
                "--ntasks=1",
                f"--nodelist={host}",
                "--overlap",
                "--export=ALL",
                f"--job-name=planaria.cleanup.{self._tag}",
                sys.executable,
                "-m",
                "planaria_slurm.cleanup",
            ]
            for pair in sorted(pairs):
                run_id, _, node_id = pair.partition("\0")
                argv += [run_id, node_id]
            procs.append(
                (
                    host,
                    process.popen(
                        argv,
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                    ),
                )
            )
        for host, proc in procs:
            try:
                output, _ = proc.communicate(timeout=_CLEANUP_TIMEOUT)
            except subprocess.TimeoutExpired:
                process.kill_group(proc.pid, 0.0)
                proc.communicate()
                log.warning("shared-memory cleanup timed out", host=host)
                continue
            if proc.returncode != 0:
                log.warning(
                    "shared-memory cleanup failed",
                    host=host,
                    output=output.decode(errors="replace")[-500:],
                )
