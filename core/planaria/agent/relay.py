"""What an agent passes on to the master besides its own reports: the persister's checkpoint
events and the workers' console lines.

Both come from elsewhere (a persister's reader thread, the log pump's buffer) and both must be
on the master before the workers' end is reported: the commit of the last step decides how a
finished job ends, and a worker's last lines (its traceback) belong on the console before the
job's end does. Neither may hold a report up for long: a flush gives up after its timeout, and
what the console could not send is counted as not shown.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

from planaria.agent.checkpoints import NodeCheckpoints
from planaria.agent.client import MasterClient
from planaria.agent.console import INTERVAL, ConsoleBuffer, batches
from planaria.background import Running
from planaria.log import get_logger
from planaria.protocol import Ack, CheckpointEvent, WorkersOutput

log = get_logger("agent")

OUTPUT_TIMEOUT = 10.0
"""The longest the workers' lines wait to be sent; a report waits 2 s at most for them."""


class Relay:
    """Passes one node's checkpoint events and console lines on to the master. ``console``:
    None when the job shows no console; ``loop``: the agent's, where sends run."""

    def __init__(
        self,
        client: MasterClient,
        node_id: str,
        console: ConsoleBuffer | None,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.client = client
        self.node_id = node_id
        self.console = console
        self.loop = loop
        self._event_sends: Running[concurrent.futures.Future[None]] = Running()
        self._console_lock = asyncio.Lock()

    def checkpoint_event(self, event: dict[str, Any]) -> None:
        """A persister event (from its reader thread): forward it to the master."""
        try:
            report = CheckpointEvent(
                node_id=self.node_id,
                event=str(event.get("event")),
                step=int(event.get("step", -1)),
                rank=event.get("rank"),
                bytes=event.get("bytes"),
                seconds=event.get("seconds"),
                error=str(event.get("error", "")),
                steps=[int(s) for s in event.get("steps") or []],
            )
        except (ValueError, TypeError) as exc:
            log.warning("bad persister event", event=event, error=str(exc))
            return
        if report.event == "shard_persisted":
            return  # the commit event says it for every rank
        sent = asyncio.run_coroutine_threadsafe(self._send_event(report), self.loop)
        self._event_sends.keep(sent)

    async def flush_checkpoint_events(self, checkpoints: NodeCheckpoints | None) -> None:
        """Before the workers' end is reported, the master learns what became of the steps
        they persisted (their commit or failure decides how a finished job ends)."""
        if checkpoints is None:
            return
        await asyncio.to_thread(checkpoints.sync, 2.0)
        pending = [asyncio.wrap_future(f) for f in self._event_sends]
        if pending:
            await asyncio.wait(pending, timeout=5.0)

    async def _send_event(self, report: CheckpointEvent) -> None:
        try:
            await self.client.call("/checkpoint/event", report, Ack)
        except Exception as exc:  # the master may be gone at the very end
            log.warning("cannot report checkpoint event", error=str(exc))

    async def forward_output(self) -> None:
        """Send the workers' lines to the master's console every :data:`INTERVAL` seconds
        (:mod:`planaria.agent.console`)."""
        if self.console is None:
            return
        while True:
            await asyncio.sleep(INTERVAL)
            await self.flush_output()

    async def flush_output(self, timeout: float = OUTPUT_TIMEOUT) -> None:
        """Send what the console has not had yet: before a report, so that a worker's last
        lines (its traceback) are on the console before the job's end is. It gives up after
        ``timeout`` seconds (a report never waits longer for the console); what it could not
        send is counted as not shown."""
        console = self.console
        if console is None:
            return
        try:
            await asyncio.wait_for(self._console_lock.acquire(), timeout)
        except asyncio.TimeoutError:
            return
        try:
            lines, dropped = console.take()
            parts = batches(lines) or ([[]] if dropped else [])
            for i, part in enumerate(parts):
                report = WorkersOutput(node_id=self.node_id, lines=part, dropped=dropped)
                try:
                    await asyncio.wait_for(self.client.call("/output", report, Ack), timeout)
                except BaseException as exc:  # lost for the console; they are in the logs
                    console.give_back(sum(len(p) for p in parts[i:]) + dropped)
                    if not isinstance(exc, Exception):
                        raise
                    log.debug("cannot forward the workers' output", error=str(exc))
                    return
                dropped = 0
        finally:
            self._console_lock.release()
