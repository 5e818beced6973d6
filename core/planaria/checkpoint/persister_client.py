"""A trainer's link to its persister: :class:`PersisterClient`.

A :class:`~planaria.checkpoint.checkpointer.Checkpointer` hands steps to the persister over this
link and waits for them to be durable. The link owns what the persister's failures ask of a
trainer: under ``planaria run`` the node's persister is the agent's, and one that went away is
reconnected to (the agent restarts it) and handed what the old one had; standalone, this link
starts the persister itself and replaces one that stops answering. Either way a persister that
stops answering never blocks training for longer than :attr:`PersisterClient.timeout`.

The protocol itself (JSON lines over a Unix socket) is :mod:`planaria.checkpoint.persister`'s.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import select
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from planaria import process
from planaria.checkpoint import persister
from planaria.checkpoint.env import GENERATION_ENV, SOCKET_ENV
from planaria.checkpoint.persisted import PersistedCheckpoints
from planaria.checkpoint.segment import Segment
from planaria.errors import StorageError
from planaria.log import get_logger

log = get_logger("checkpoint")


class PersisterClient:
    """One trainer's connection to its persister (the agent's under ``planaria run``, else its
    own, started in ``directory`` at first use).

    ``segment`` and ``store`` give the trainer's current segment (the one a ``hello`` announces)
    and its storage; ``rejected`` is the trainer's own mapping of the committed steps a restore
    rejected, shared, so that every ``hello`` names those found since."""

    def __init__(
        self,
        *,
        spec: dict[str, Any],
        keep_last: int,
        segment_path: Path,
        managed: bool,
        timeout: float,
        directory: Path | None,
        segment: Callable[[], Segment | None],
        store: Callable[[], PersistedCheckpoints],
        rejected: dict[int, str],
    ) -> None:
        self.spec = spec
        self.keep_last = keep_last
        self.segment_path = segment_path
        self.managed = managed
        self.timeout = timeout
        """The most seconds a request waits for an answer (``persister_timeout``)."""
        self._directory = directory
        self._segment = segment
        self._store = store
        self.rejected = rejected
        self.lost = False
        """Under ``planaria run``: the persister stopped answering; the next connection hands
        the agent's new one what was pending."""
        self._announced: Segment | None = None
        """The segment the persister has open."""
        self._sock: socket.socket | None = None
        self._reader: Any = None
        self.pending: collections.deque[int] = collections.deque(maxlen=3)
        """Steps handed to the persister since it last said ``idle``: a restarted persister
        is asked for them again (older ones are no longer in memory: three slots)."""
        self.process: subprocess.Popen[bytes] | None = None
        """Standalone: the persister this link started."""
        self._ready = False
        """Standalone: whether the persister said it serves its socket."""
        self._tmpdir: str | None = None

    def _connect(self, hello: bool = True) -> None:
        if self._sock is not None:
            return
        path = os.environ[SOCKET_ENV] if self.managed else self._start_persister()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # The node's persister may be (re)starting; once training runs, not for longer than a
        # save may wait for it.
        deadline = time.monotonic() + (self.timeout if self.lost else 30)
        while True:
            try:
                sock.connect(path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    sock.close()
                    raise
                time.sleep(0.05)
        self._sock = sock
        self._reader = sock.makefile("rb")
        if hello:
            self._hello()

    def _hello_message(self) -> dict[str, Any]:
        return {
            "op": "hello",
            "segment": str(self.segment_path),
            "storage": self.spec,
            "keep_last": self.keep_last,
            "rejected": sorted(self.rejected),
            "generation": _generation(),
        }

    def _hello(self) -> None:
        self._request(self._hello_message(), "ready")
        self._announced = self._segment()

    def _start_persister(self) -> str:
        if self.process is None:
            self._spawn_persister()
        assert self.process is not None and self.process.stdout is not None
        path = self._socket_path()
        if self._ready:
            return path
        ready, _, _ = select.select([self.process.stdout], [], [], 60)
        line = self.process.stdout.readline() if ready else b""
        self._ready = line.strip() == b"ready"
        if not self._ready:
            self.process.kill()
            self.process.wait()
            self.process = None  # the private directory goes at close()
            raise StorageError(f"the checkpoint persister did not start: {line!r}")
        return path

    def _spawn_persister(self) -> None:
        """Start the persister, without waiting for it to be ready (:meth:`_start_persister`
        does, at its first use)."""
        assert self._directory is not None
        self._tmpdir = str(self._directory)
        # It follows this process itself (--parent), to finish a persist first.
        self.process = process.popen(
            persister.command(
                self._socket_path(), self.spec, self.keep_last, str(self.segment_path)
            ),
            die_with_parent=False,
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
        )
        self._ready = False

    def _ask(
        self,
        message: dict[str, Any],
        expect: str,
        timeout: float | None = -1.0,
        *,
        sent: bool = False,
    ) -> dict[str, Any]:
        """One request, answered within ``timeout`` (default :attr:`timeout`; None: no limit);
        :class:`ConnectionError` if the persister is gone, :class:`TimeoutError` if it does not
        answer (the connection is dropped: a late answer would be misread)."""
        assert self._sock is not None
        self._sock.settimeout(self.timeout if timeout == -1.0 else timeout)
        try:
            return persister.ask(self._sock, self._reader, message, expect, send=not sent)
        except ConnectionError:
            raise
        except TimeoutError:
            self._drop()
            raise
        except OSError as exc:
            raise StorageError(str(exc)) from exc

    def _request(
        self,
        message: dict[str, Any],
        expect: str,
        timeout: float | None = -1.0,
        *,
        sent: bool = False,
    ) -> dict[str, Any]:
        """One request. A persister that stopped answering is replaced (standalone here,
        under ``planaria run`` by the agent) and the request is not waited for any longer.
        Under ``planaria run`` a persister that died is restarted by the agent: reconnect,
        hand the new one what the old one had, and ask again."""
        try:
            return self._ask(message, expect, timeout, sent=sent)
        except TimeoutError as exc:
            self._hung(message)
            raise StorageError(
                f"the checkpoint persister did not answer within {self.timeout:g}s"
            ) from exc
        except ConnectionError as exc:
            if not self.managed:
                raise StorageError(str(exc)) from exc
            log.warning("the persister went away; reconnecting", error=str(exc))
            try:
                self._reconnect()
                return self._ask(message, expect, timeout)
            except OSError as again:  # ConnectionError included
                self._drop()
                raise StorageError(f"the node's persister is gone: {again}") from again

    def _hung(self, message: dict[str, Any]) -> None:
        """The persister stopped answering (stopped, or hung in the kernel on its storage)."""
        if self.managed:
            log.warning(
                "the node's persister stopped answering; its agent replaces it",
                op=message.get("op"),
                timeout=self.timeout,
            )
            self.lost = True
            return
        old = self.process
        log.warning(
            "the checkpoint persister stopped answering; replacing it",
            op=message.get("op"),
            timeout=self.timeout,
            pid=old.pid if old is not None else None,
        )
        self._drop()
        if old is not None:
            old.kill()  # SIGKILL ends a stopped process too; its locks go with it
            old.wait()
            self.process = None
        try:  # started now, connected to at the next persist or wait: nobody waits for it
            self._spawn_persister()
        except OSError as exc:
            log.warning("cannot start a new checkpoint persister", error=str(exc))
        self.lost = True

    def _drop(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
        self._sock = self._reader = None

    def _reconnect(self) -> None:
        announced = self._announced is not None
        self._drop()
        self._connect(hello=False)
        if announced:
            self._ask(self._hello_message(), "ready")
            self._announced = self._segment()
        # What was committed meanwhile needs nothing; what was only pinned is asked again.
        store = self._store()
        store.reject(self.rejected)
        newest = next((s for s in store.committed_steps() if store.usable(s)), -1)
        for step in [s for s in self.pending if s > newest]:
            try:
                self._ask({"op": "persist", "step": step}, "pinned")
            except StorageError as exc:  # no longer in memory: the persister reported it
                log.warning(
                    "cannot persist again after a persister restart", step=step, error=str(exc)
                )

    def persist(self, step: int) -> None:
        """Hand ``step`` (published in the segment) to the persister; a failure is logged,
        never raised: training goes on."""
        # Pending from now on: a persister replaced before it answers is asked again.
        self.pending.append(step)
        try:
            if self.lost and self._sock is None:
                self._reconnect()
                self.lost = False
                return  # handed over with what was pending
            self._connect()
            if self._announced is not self._segment():  # a new (larger) segment replaced it
                self._hello()
            self._request({"op": "persist", "step": step}, "pinned")
        except (OSError, StorageError) as exc:
            if self._sock is None and self.managed:
                self.lost = True
            log.warning("cannot persist", step=step, error=str(exc))

    def wait(self) -> None:
        """Block until every step handed to the persister is durable (see
        :meth:`Checkpointer.wait <planaria.checkpoint.checkpointer.Checkpointer.wait>`)."""
        if self.lost and self._sock is None and self.pending:
            with contextlib.suppress(OSError, StorageError):
                self._reconnect()
                self.lost = False
        if self._sock is None:
            return
        reply = self._wait_idle()
        self.pending.clear()
        if reply.get("errors"):
            message = "persisting failed: " + "; ".join(reply["errors"])
            if not self.managed:
                raise StorageError(message)
            log.warning("persisting failed; the job's timeline has it", errors=reply["errors"])

    def _wait_idle(self) -> dict[str, Any]:
        """``wait``, as long as persisting takes, but not on a persister that stopped
        answering: every :attr:`timeout` without an answer it is pinged on a connection of its
        own; one that does not answer is replaced (standalone here, under ``planaria run`` by
        the agent, which ends this connection) and asked again."""
        message = {"op": "wait"}
        while True:
            assert self._sock is not None
            try:
                self._sock.settimeout(None)
                self._sock.sendall(json.dumps(message).encode() + b"\n")
                while not select.select([self._sock], [], [], self.timeout)[0]:
                    if not self._answers_ping() and not self.managed:
                        raise TimeoutError("no answer to a ping")
                return self._request(message, "idle", None, sent=True)
            except TimeoutError:
                self._hung(message)
                self._reconnect()  # the new one is asked what the old one had, and waited for
                self.lost = False
            except ConnectionError:
                return self._request(message, "idle", None)  # reconnects under planaria run

    def _answers_ping(self) -> bool:
        path = os.environ[SOCKET_ENV] if self.managed else self._socket_path()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(self.timeout)
                sock.connect(path)
                with sock.makefile("rb") as reader:
                    persister.ask(sock, reader, {"op": "ping"}, "pong")
            return True
        except (OSError, ValueError):
            return False

    def _socket_path(self) -> str:
        return os.path.join(self._tmpdir or "", "persister.sock")

    def report(self, event: str, **fields: Any) -> None:
        """Tell the job (through the node's persister) how the restore went."""
        if not self.managed:
            return
        try:
            self._connect(hello=False)
            self._request({"op": "report", "event": event, **fields}, "reported")
        except (OSError, StorageError) as exc:
            log.warning("cannot report to the agent", event=event, error=str(exc))

    def close(self) -> None:
        """Close the connection; standalone, stop the persister (it finishes what was pinned).
        Its socket goes at :meth:`remove_socket`."""
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.process = None

    def remove_socket(self) -> None:
        """Standalone: remove the socket a killed persister leaves, and its directory if empty."""
        if self._tmpdir is not None:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self._tmpdir, "persister.sock"))
            with contextlib.suppress(OSError):
                os.rmdir(self._tmpdir)
            self._tmpdir = None


def _generation() -> int:
    """The round this worker runs in (``PLANARIA_GENERATION``, set by its agent): what it
    persists carries it, so that a round the master fenced out cannot commit."""
    value = os.environ.get(GENERATION_ENV, "0")
    return int(value) if value.isdigit() else 0
