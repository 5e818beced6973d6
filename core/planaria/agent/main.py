"""The agent's life: register, join a round, run the workers, report, obey the master.

One agent per node, started by the scheduler (``planaria agent``). Workers get exactly
torchrun's environment (:mod:`planaria.agent.worker_env`), so a torchrun-ready script runs
unchanged. Nothing the agent starts outlives it: workers and the warm interpreter die with it,
even on SIGKILL.

Why one module: the agent's life is one loop over rounds (check, join, start the workers,
watch them, report, do what the master answers), and each step reads and changes the same
round's state and the same connection to the master; a step moved out would take that state
along as arguments. What stands alone already does: starting and stopping workers
(:mod:`~planaria.agent.workers`), the node's checkpoints (:mod:`~planaria.agent.checkpoints`),
passing events and console lines on (:mod:`~planaria.agent.relay`), the pre-flight check
(:mod:`~planaria.agent.preflight`) and the timer over an attempt
(:mod:`~planaria.diagnosis.watch`).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from pathlib import Path
from urllib.parse import urlparse

from planaria.agent import address
from planaria.agent.address import ADDR_ENV, free_port
from planaria.agent.checkpoints import NodeCheckpoints
from planaria.agent.client import FencedOut, MasterClient, MasterUnreachable
from planaria.agent.console import ConsoleBuffer, console_streams
from planaria.agent.preflight import preflight
from planaria.agent.relay import Relay
from planaria.agent.worker_env import worker_env
from planaria.agent.worker_logs import LogLimits
from planaria.agent.workers import (
    GroupResult,
    WorkerExit,
    WorkerGroup,
    WorkerLauncher,
    WorkerSpec,
    WorkerStartRefused,
)
from planaria.background import Running
from planaria.chaos import ENV as CHAOS_ENV
from planaria.chaos import ChaosRule, worker_rules_env
from planaria.diagnosis.gate import check_node
from planaria.diagnosis.messages import HangReport, HealthReport
from planaria.diagnosis.watch import NodeWatch
from planaria.errors import PlanariaError
from planaria.log import bind, get_logger
from planaria.progress import ENV as PROGRESS_ENV
from planaria.progress import ProgressBoard
from planaria.protocol import (
    SPREAD_NODES,
    Ack,
    Action,
    ActionRequest,
    ChaosReport,
    Heartbeat,
    HeartbeatReply,
    JoinReply,
    JoinRequest,
    ReattachReply,
    ReattachRequest,
    RegisterReply,
    RegisterRequest,
    RendezvousInfo,
    ReplicaFetch,
    RoundDirectives,
    WorkerFailure,
    WorkersReport,
)
from planaria.shm import UnsafePathError, make_private_dir, node_dir, remove_dir

log = get_logger("agent")

POLL = 0.02


def node_address(master_url: str) -> str:
    """Where other nodes reach this one: ``PLANARIA_ADDR``, loopback when the master is on
    loopback (every node is on this machine), else the local address of the route to the
    master (see :mod:`planaria.agent.address`)."""
    return address.node_address(urlparse(master_url).hostname or "", os.environ.get(ADDR_ENV))


class Agent:
    def __init__(self, client: MasterClient, node_id: str, host: str, addr: str) -> None:
        self.client = client
        self.node_id = node_id
        self.host = host
        self.addr = addr
        self._sends: Running[asyncio.Future[None]] = Running()
        self._round: RendezvousInfo | None = None
        """The round this node's workers run, while they do."""
        self.checkpoints: NodeCheckpoints | None = None
        self.console: ConsoleBuffer | None = None
        self._restart_reason = ""
        """Why the master restarted the workers: what the next round's logs are marked with."""

    async def run(self) -> int:
        reply = await self.client.call(
            "/register",
            RegisterRequest(node_id=self.node_id, host=self.host, addr=self.addr, pid=os.getpid()),
            RegisterReply,
        )
        spec = self.spec = reply.spec
        bind(job=spec.job, node=self.node_id)
        # From here on the workers run: an outage of the master is ridden out for the grace
        # (a restarted master takes the job over), and then they are stopped.
        self.client.give_up_after = spec.master_grace
        # Long polls are held for the heartbeat interval (a join for 5s): a longer silence
        # is a master that is gone or cut off.
        self.client.read_timeout = max(spec.heartbeat_timeout, spec.heartbeat_interval + 5, 10.0)
        self.client.reattach = self._reattach
        base_env = {**os.environ, **spec.env, "PLANARIA_RUN_DIR": spec.run_dir}
        if spec.procs_per_node > 1:
            base_env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does
        # Every file this node puts in /dev/shm is in one private directory, made afresh: no
        # other user can plant or swap anything in it, and removing it frees them all.
        try:
            shm = make_private_dir(node_dir(spec.run_id, self.node_id))
        except UnsafePathError as exc:
            log.error("cannot make this node's shared-memory directory", error=str(exc))
            return 1
        self.loop = asyncio.get_running_loop()
        if spec.console:
            self.console = ConsoleBuffer()
        self.relay = Relay(self.client, self.node_id, self.console, self.loop)
        try:
            if spec.checkpoint is not None:
                self.checkpoints = NodeCheckpoints(
                    spec.checkpoint, shm, self.relay.checkpoint_event
                )
                self.checkpoints.start()
                self.checkpoints.start_replicas(
                    self.node_id, self.addr, self.client.token, spec.procs_per_node
                )
            self.board = ProgressBoard(shm / "progress", spec.procs_per_node)
        except BaseException:
            if self.checkpoints is not None:
                self.checkpoints.stop()
            remove_dir(shm)
            raise
        launcher = WorkerLauncher(
            spec.command,
            Path(spec.workdir),
            base_env,
            spec.preload,
            spec.stop_grace,
            log_limits=LogLimits(spec.log_max_bytes, spec.log_keep),
            console=self.console,
        )
        warming = asyncio.ensure_future(launcher.start())
        forwarding = asyncio.ensure_future(self.relay.forward_output())
        checked = not spec.diagnosis.preflight
        try:
            while True:
                if not await self._healthy():
                    return 0
                if not checked:  # once, before the first round this node joins
                    checked = True
                    if not await preflight(
                        self.client, self.node_id, self.host, self.addr, free_port, spec.chaos
                    ):
                        return 0
                joined = await self._join()
                if joined is None or joined.info is None:
                    return 0
                await self._warm(warming, joined.info)
                action = await self._run_round(launcher, joined.info, joined.directives, base_env)
                if action.kind == "exit":
                    return 0
                self._restart_reason = action.reason
        finally:
            warming.cancel()
            forwarding.cancel()
            await launcher.close()
            await self.relay.flush_output(timeout=2.0)
            self.board.close()
            if self.checkpoints is not None:
                await asyncio.to_thread(self.checkpoints.stop)
            remove_dir(shm)

    async def _warm(self, warming: asyncio.Future[None], info: RendezvousInfo) -> None:
        """Wait for the warm interpreter (its torch import can take seconds on a busy
        machine), telling the master meanwhile that this node is alive."""
        while not warming.done():
            await asyncio.wait({warming}, timeout=self.spec.heartbeat_interval)
            if not warming.done():
                beat = Heartbeat(
                    node_id=self.node_id, round=info.round, activity="idle", wait=False
                )
                await self.client.call("/heartbeat", beat, HeartbeatReply)
        warming.result()

    async def _reattach(self) -> None:
        """Tell a restarted master what this node runs, so that it goes on with it."""
        info = self._round
        board: ProgressBoard | None = getattr(self, "board", None)
        last = max((p.step for p in board.read_all()), default=-1) if board else -1
        checkpoints = self.checkpoints
        request = ReattachRequest(
            node_id=self.node_id,
            host=self.host,
            addr=self.addr,
            pid=os.getpid(),
            round=None if info is None else info.round,
            node_rank=None if info is None else info.node_rank,
            last_step=last,
            memory=checkpoints.holdings(self.spec.procs_per_node) if checkpoints else [],
        )
        await self.client.call("/reattach", request, ReattachReply)
        log.info("re-attached to the master", round=request.round, last_step=last)

    async def _healthy(self) -> bool:
        """Run the job's health checks before joining a round. An unhealthy node does not
        join: it reports why and leaves, and the master replaces it, avoiding its host."""
        diagnosis = self.spec.diagnosis
        failures = await asyncio.to_thread(
            check_node, diagnosis, self.host, Path(self.spec.workdir)
        )
        if not failures:
            return True
        log.error("node unhealthy: not joining", failures=[f.model_dump() for f in failures])
        report = HealthReport(
            node_id=self.node_id, host=self.host, failures=failures, time=time.time()
        )
        await self.client.call("/health", report, Ack)
        return False

    async def _join(self) -> JoinReply | None:
        """Join the next round and wait for it to close, through the same client (and the
        same retries through a short master outage) as every other call to the master."""
        last = max((p.step for p in self.board.read_all()), default=-1)
        checkpoints = self.checkpoints
        server = checkpoints.replica_server if checkpoints else None
        request = JoinRequest(
            node_id=self.node_id,
            addr=self.addr,
            port=free_port(self.addr),
            last_step=last,
            memory=checkpoints.holdings(self.spec.procs_per_node) if checkpoints else [],
            replica_port=None if server is None else server.port,
            replicas=checkpoints.replicas() if checkpoints else [],
        )
        while True:
            reply = await self.client.call("/rendezvous/join", request, JoinReply)
            if reply.state == "exit":
                log.info("the job is over; exiting", reason=reply.reason)
                return None
            if reply.state == "ready" and reply.info is not None:
                return reply

    async def _run_round(
        self,
        launcher: WorkerLauncher,
        info: RendezvousInfo,
        directives: RoundDirectives,
        base_env: dict[str, str],
    ) -> Action:
        spec, restart_count = self.spec, directives.restart_count
        self.board.reset()
        extra = {
            **base_env,
            PROGRESS_ENV: str(self.board.path),
            CHAOS_ENV: worker_rules_env(spec.chaos),
            "PLANARIA_NODE_ID": self.node_id,
        }
        logs = Path(spec.log_dir) if spec.log_dir else Path(spec.run_dir) / "logs"
        header = b""
        if restart_count > 0:  # a restart is marked in every log it appends to
            at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            why = self._restart_reason or "the job restarted"
            header = (
                f"==== planaria: restart {restart_count} (round {info.round}) at {at}: {why} ====\n"
            ).encode()
        checkpoints = self.checkpoints
        if checkpoints is not None:
            checkpoints.replica_round(info.round, directives.replica_to)
            failed = await checkpoints.fetch_replicas(directives.fetch)
            if failed is not None:
                wanted, error = failed
                why = (
                    f"cannot fetch rank {wanted.rank}'s step {wanted.step} from "
                    f"{wanted.holder.node_id}'s replica: {error}"
                )
                return await self._cannot_start(info, why, replica=wanted)
        if checkpoints is not None and directives.persist_step is not None:
            # Persist at fault: pin the agreed step before workers can save over it.
            step = directives.persist_step
            ranks = list(range(spec.procs_per_node))
            errors = await checkpoints.persist(step, ranks, 30.0, info.round)
            for error in errors:
                log.warning("cannot persist step at fault", step=step, error=error)
        specs = [
            WorkerSpec(
                local_rank=lr,
                env={
                    **worker_env(spec, info, lr, restart_count, extra),
                    **(
                        checkpoints.worker_env(lr, directives.restore, info.round)
                        if checkpoints
                        else {}
                    ),
                },
                log_path=logs / f"rank-{info.rank_offset + lr}.log",
                rank=info.rank_offset + lr,
                console=console_streams(spec, lr),
                header=header,
            )
            for lr in range(spec.procs_per_node)
        ]
        try:
            group = await launcher.spawn(specs)
        except WorkerStartRefused as exc:
            return await self._cannot_start(info, str(exc))
        started = time.time()
        self._round = info
        log.info("workers started", round=info.round, node_rank=info.node_rank, pids=group.pids)
        watch = NodeWatch(spec.diagnosis, self.node_id, info.round, info.rank_offset, started)
        round_state = _RoundState(info, started, watch)
        waiting = asyncio.ensure_future(group.wait())
        watching = asyncio.ensure_future(self._watch(group, round_state, restart_count))
        beating = asyncio.ensure_future(self._heartbeats(round_state))
        try:
            while True:
                done, _ = await asyncio.wait(
                    {waiting, beating}, return_when=asyncio.FIRST_COMPLETED
                )
                if waiting in done and not round_state.reported:
                    await self._report(round_state, waiting.result())
                if beating in done:
                    action = beating.result()
                    if action.kind == "restart" and action.round <= info.round:
                        # Told before this node joined the round it runs: it is restarted.
                        log.debug("a restart into this round: already in it", round=info.round)
                    elif action.kind in ("restart", "exit"):
                        await group.stop()
                        await self._report_unreported(round_state, group.exits())
                        return action
                    beating = asyncio.ensure_future(self._heartbeats(round_state))
        finally:
            self._round = None
            for task in (waiting, watching, beating):
                task.cancel()
            await group.stop()

    async def _cannot_start(
        self, info: RendezvousInfo, error: str, replica: ReplicaFetch | None = None
    ) -> Action:
        """Workers that cannot start (a missing program, an environment the OS refuses, a node
        too small for them) are the job's fault, not this node's: the round fails with the
        OS's reason, and the node waits for the master's word (it stops the job). A replica
        that cannot be fetched is no such fault (``replica``): the master restarts the round
        without it."""
        log.error("workers cannot start", round=info.round, error=error)
        now = time.time()
        failure = WorkerFailure(
            local_rank=0,
            rank=info.rank_offset,
            pid=0,
            exitcode=None,
            signal=None,
            time=now,
            log_tail="",
            description=error,
            start_error=None if replica else error,
            replica_error=replica,
        )
        report = WorkersReport(
            node_id=self.node_id, round=info.round, succeeded=False, failure=failure
        )
        await self.client.call("/workers", report, Ack)
        watch = NodeWatch(self.spec.diagnosis, self.node_id, info.round, info.rank_offset, now)
        state = _RoundState(info, now, watch)
        state.reported, state.activity = True, "failed"
        while True:
            action = await self._heartbeats(state)
            if action.kind in ("restart", "exit"):
                return action

    async def _report(self, state: _RoundState, result: GroupResult) -> None:
        state.reported = True
        await self.relay.flush_output(timeout=2.0)
        await self.relay.flush_checkpoint_events(self.checkpoints)
        state.activity = "succeeded" if result.succeeded else "failed"
        failures = [
            self._failure(state, e)
            for e in result.exits
            if _failed_by_itself(e) and e is not result.first_failure
        ]
        first = None
        if result.first_failure is not None:
            first = self._failure(state, result.first_failure)
            log.warning("worker failed", rank=first.rank, reason=first.description)
        slots = self.board.read_all()
        await self.client.call(
            "/workers",
            WorkersReport(
                node_id=self.node_id,
                round=state.info.round,
                succeeded=result.succeeded,
                failure=first,
                also=failures,
                last_step=max((p.step for p in slots), default=-1),
                progress=state.watch.progress(slots),
            ),
            Ack,
        )

    async def _report_unreported(self, state: _RoundState, exits: list[WorkerExit]) -> None:
        """The master's action can overtake this node's own failure (a peer's report came
        first): report what failed here anyway, so that the timeline keeps the root cause."""
        if state.reported:
            return
        failed = [e for e in exits if _failed_by_itself(e)]
        if failed:
            first, *others = sorted(failed, key=lambda e: e.time)
            result = GroupResult(succeeded=False, first_failure=first, exits=[first, *others])
            await self._report(state, result)

    def _failure(self, state: _RoundState, f: WorkerExit) -> WorkerFailure:
        return WorkerFailure(
            local_rank=f.local_rank,
            rank=state.info.rank_offset + f.local_rank,
            pid=f.pid,
            exitcode=f.exitcode,
            signal=f.signal,
            time=f.time,
            log_tail=f.log_tail,
            description=f.describe(),
            log_path=f.log_path or None,
        )

    def _beat(self, state: _RoundState, wait: bool) -> Heartbeat:
        progress = state.watch.progress(self.board.read_all())
        return Heartbeat(
            node_id=self.node_id,
            round=state.info.round,
            activity=state.activity,
            progress=progress,
            first_step_time=state.first_step_time,
            wait=wait,
        )

    async def _heartbeats(self, state: _RoundState) -> Action:
        """The master's next action, pushed down the channel the moment it decides it; its
        progress goes up meanwhile, a heartbeat each ``heartbeat_interval``."""
        request = ActionRequest(node_id=self.node_id, round=state.info.round)
        pushed = asyncio.ensure_future(self.client.call("/actions", request, HeartbeatReply))
        try:
            if state.info.num_nodes >= SPREAD_NODES:  # not in one wave with every other node
                await asyncio.wait({pushed}, timeout=random.random() * self.spec.heartbeat_interval)
            while not pushed.done():
                await self.client.tell("/heartbeat", self._beat(state, wait=False))
                await asyncio.wait({pushed}, timeout=self.spec.heartbeat_interval)
            return pushed.result().action
        finally:
            pushed.cancel()

    async def _watch(self, group: WorkerGroup, state: _RoundState, restart_count: int) -> None:
        """Notice the first step (to time recovery), hangs and step times, and fire agent-side
        chaos rules."""
        rules = [
            r
            for r in self.spec.chaos
            if r.attempt == restart_count and not r.in_worker and not r.in_preflight
        ]
        rank_range = range(
            state.info.rank_offset, state.info.rank_offset + self.spec.procs_per_node
        )
        while True:
            await asyncio.sleep(POLL)
            slots = self.board.read_all()
            steps = [p for p in slots if p.step >= 0]
            if state.first_step_time is None and steps:
                state.first_step_time = min(p.time for p in steps)
                # Tell the master now (it times recovery), not at the next long poll; in the
                # background, so that an outage of the master does not hold this watch up.
                self._send(self._beat(state, wait=False))
            alive = group.running and not state.reported
            await state.watch.tick(slots, group.pids, alive, self._report_hang)
            top = max((p.step for p in steps), default=-1)
            elapsed = time.time() - state.started
            for rule in list(rules):
                due = (rule.at_step is not None and top >= rule.at_step) or (
                    rule.after is not None and elapsed >= rule.after
                )
                if not due:
                    continue
                if rule.kind == "kill_node" and rule.node_rank == state.info.node_rank:
                    await self._kill_self(rule, top)
                elif rule.kind == "kill_worker" and rule.rank in rank_range:
                    assert rule.rank is not None
                    rules.remove(rule)
                    log.warning("chaos: killing worker", rank=rule.rank)
                    group.kill(rule.rank - state.info.rank_offset)
                else:
                    rules.remove(rule)

    def _send(self, beat: Heartbeat) -> None:
        async def send() -> None:
            await self.client.tell("/heartbeat", beat)

        self._sends.start(send())

    async def _report_hang(self, report: HangReport) -> None:
        try:
            await self.client.call("/hang", report, Ack)
        except PlanariaError as exc:
            log.error("could not report the hang", error=str(exc))

    async def _kill_self(self, rule: ChaosRule, step: int) -> None:
        log.warning("chaos: killing this node's agent", rule=rule.model_dump(mode="json"))
        report = ChaosReport(node_id=self.node_id, rule=rule, time=time.time(), step=step)
        try:
            await asyncio.wait_for(self.client.call("/chaos", report, Ack), timeout=2)
        finally:
            os.kill(os.getpid(), signal.SIGKILL)


def _failed_by_itself(exit_: WorkerExit) -> bool:
    """A worker that exited with an error code failed by itself, even if the stop order
    reached it before its exit was seen: a worker that was stopped dies of the signal."""
    return not exit_.ok and (not exit_.stopped or exit_.signal is None)


class _RoundState:
    def __init__(self, info: RendezvousInfo, started: float, watch: NodeWatch) -> None:
        self.info = info
        self.started = started
        self.watch = watch
        self.activity: str = "running"
        self.reported = False
        self.first_step_time: float | None = None


async def main(
    master_url: str, token: str, node_id: str, host: str, fingerprint: str | None = None
) -> int:
    client = MasterClient(master_url, token, fingerprint=fingerprint)
    addr = node_address(master_url)
    # Gloo binds this address's interface: workers and pre-flight benchmarks inherit it.
    os.environ.update(address.gloo_interface(addr, os.environ))
    agent = Agent(client, node_id, host, addr)
    task = asyncio.ensure_future(agent.run())
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    try:
        return await task
    except asyncio.CancelledError:
        log.info("agent stopped by signal")
        return 143
    except FencedOut as exc:
        log.error("fenced by the master: workers stopped", reason=str(exc))
        return 3
    except MasterUnreachable as exc:
        log.error(
            "the master has been gone for the grace: workers stopped, the job cannot be "
            "steered without it",
            error=str(exc),
        )
        return 4
    finally:
        await client.close()
