"""The workers' store on the master's host (``rendezvous.store: master``).

By default the worker of global rank 0 hosts torch.distributed's TCPStore, on its node: losing
that node loses the store every other worker of the round talks to, and the round after it
waits for a new rank 0 to bind one. With ``rendezvous.store: master`` a small process beside
the master, started with the job, serves the store instead, and every worker, rank 0 included,
connects to it as a client (``TORCHELASTIC_USE_AGENT_STORE=True``,
:func:`planaria.agent.worker_env.worker_env`).

Why a process of its own: serving a TCPStore takes torch, and the master does not import it
(a master that imports torch starts 1-2 s later and weighs hundreds of megabytes more). The
process imports it once, at the job's start, off the recovery path.

Why a fresh store per round, each on its own port: process groups keep their keys in the store
(``init/`` counts its clients, the ranks' addresses...), and torch's ``env://`` initialisation
takes no prefix; a later round reading an earlier round's keys would meet ghosts. The store
host always holds one store ready, bound and unused, so that a round closes without waiting for
one: the round takes it (:meth:`StoreHost.take`), the host closes the stores of earlier rounds
(their workers are gone: a round closes once every member's agent joined it again) and readies
the next. A round's store stays up while that round trains.

The store host dies with the master: it exits when its standard input (a pipe from the master)
reaches its end, which the kernel makes happen however the master ends, ``SIGKILL`` included,
and when its parent changes (a pipe inherited by some other process would keep the first from
happening). A restarted master starts a store host of its own: the round it resumes keeps
training on process groups already formed (their store died with the master before: a script
that creates a process group mid-round needs ``rank0``), and the next round gets a store again.

The protocol, one line each way: the host writes ``ready PORT`` when a store listens on PORT,
unused; the master writes ``serve ROUND`` when ROUND takes it.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from planaria.log import get_logger

log = get_logger("master")

STOP_GRACE = 5.0
"""Seconds the store host gets to exit once its input closed, before it is killed."""
WATCH_EVERY = 0.5
"""Seconds between two looks of the store host at its parent."""


class StoreHost:
    """The master's side of the store host: start it, take a round's store, close it.

    Not thread-safe beyond what it needs: :meth:`take` and :meth:`close` are called from the
    master's loop; a thread of its own reads the host's ``ready`` lines."""

    def __init__(self, address: str, log_path: Path) -> None:
        self.address = address
        """Where the agents reach the master's host: what workers are told to connect to."""
        self.log_path = log_path
        self._proc: subprocess.Popen[str] | None = None
        self._spare: int | None = None
        self._lock = threading.Lock()
        self._starts = 0

    def start(self) -> None:
        """Start the store host (it imports torch meanwhile; :meth:`take` waits for it)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("a") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "planaria.master.store"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                bufsize=1,
            )
        self._proc = proc
        self._starts += 1
        with self._lock:
            self._spare = None
        assert proc.stdout is not None
        threading.Thread(
            target=self._read, args=(proc, proc.stdout), name="store-host", daemon=True
        ).start()

    def _read(self, proc: subprocess.Popen[str], out: IO[str]) -> None:
        for line in out:
            kind, _, port = line.strip().partition(" ")
            if kind == "ready" and port.isdigit():
                with self._lock:
                    if self._proc is proc:
                        self._spare = int(port)

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def take(self, round_: int) -> tuple[str, int] | None:
        """The address and port of a store for round ``round_``, serving already; None while
        none is ready yet (the store host is starting: ask again). A store host that died is
        started again."""
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is not None:
            log.error(
                "the workers' store host exited; starting it again",
                code=proc.returncode,
                log=str(self.log_path),
            )
            self.start()
            return None
        with self._lock:
            port, self._spare = self._spare, None
        if port is None:
            return None
        try:
            assert proc.stdin is not None
            proc.stdin.write(f"serve {round_}\n")
            proc.stdin.flush()
        except OSError:  # it died after its last word: the next tick starts it again
            return None
        return self.address, port

    def close(self) -> None:
        """Stop the store host (its input closes: it exits), killing it if it lingers."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            if proc.stdin is not None:
                proc.stdin.close()
        try:
            proc.wait(STOP_GRACE)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


# -- the store host's own process ----------------------------------------------------------


def _watch(parent: int) -> None:
    """Exit once the parent is gone (another process holding the pipe keeps its end away)."""
    while os.getppid() == parent:
        time.sleep(WATCH_EVERY)
    os._exit(0)


def _new_store() -> Any:
    from datetime import timedelta

    import torch.distributed as dist

    # Port 0: the kernel gives a free port, bound at once (no window for another to take it).
    # The host's own client connects on loopback; the server listens on every interface.
    # torch.distributed imports TCPStore from its extension without naming it in __all__.
    return dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )


def main() -> None:
    threading.Thread(target=_watch, args=(os.getppid(),), daemon=True).start()
    stores: dict[int, Any] = {}
    spare = _new_store()
    print(f"ready {spare.port}", flush=True)
    for line in sys.stdin:
        kind, _, value = line.strip().partition(" ")
        if kind != "serve" or not value.lstrip("-").isdigit():
            print(f"store host: ignored {line.strip()!r}", file=sys.stderr, flush=True)
            continue
        round_ = int(value)
        stores[round_] = spare
        for earlier in [r for r in stores if r < round_]:
            del stores[earlier]  # its server stops with it
        spare = _new_store()
        print(f"ready {spare.port}", flush=True)
    os._exit(0)  # the master is gone: no teardown of torch's threads to wait for


if __name__ == "__main__":
    main()
