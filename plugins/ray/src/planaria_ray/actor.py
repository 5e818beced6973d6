"""The actor each node is: it starts the node's agent on its Ray node and watches it.

An actor is a Ray worker process of its own (``max_restarts=0``: Ray never starts it again,
the master alone decides what replaces a lost node). It starts ``LaunchSpec.command`` (the
agent) in a session of its own from a thread that lives as long as the actor, with the death
signal set (:func:`planaria.process.popen`): when the actor's process ends for any reason,
``ray.kill``, its raylet killed, its machine gone, the agent gets SIGKILL, and the agent takes
its workers with it. The actor's environment is the runtime environment's (``env_vars``:
the master's URL, the job token, the node id), which the agent inherits; nothing of it is
logged. What Ray adds to its workers' environment for Ray's own sake is taken out again
(:data:`RAY_ADDS`), so that the agent starts its workers with torchrun's environment exactly
as under the local scheduler: Ray's ``OMP_NUM_THREADS=<the actor's CPUs>`` would change the
workers' thread count, and with it the bits of their results.

Methods run on a small thread pool (``max_concurrency``), so that :meth:`NodeActor.stop` is
served while :meth:`NodeActor.wait` blocks on the agent's exit.

An actor that outlives the driver (``lifetime="detached"``, for a job that can be resumed)
ends itself once its agent has ended and no driver took the exit status within ``linger``
seconds: a detached actor nobody ends would hold its Ray node's resources for ever.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
from pathlib import Path
from typing import Any

from planaria import process
from planaria.scheduler.local import open_node_log

PR_SET_CHILD_SUBREAPER = 36
RAY_ADDS = ("OMP_NUM_THREADS",)
"""Variables Ray sets in a worker it starts, unless the runtime environment asked for them."""


class NodeActor:
    """One node: its agent process, started at once (see the module docstring)."""

    def __init__(
        self,
        command: list[str],
        node_id: str,
        log_dir: str | None,
        linger: float,
        asked: list[str],
    ) -> None:
        # Orphans of the node (a worker's child whose worker died first) come back to us,
        # and die with this process at the latest.
        with contextlib.suppress(OSError, AttributeError):
            process.prctl(PR_SET_CHILD_SUBREAPER, 1)
        self._command = command
        self._node_id = node_id
        self._log_dir = log_dir
        self._linger = linger
        self._env = {k: v for k, v in os.environ.items() if k in asked or k not in RAY_ADDS}
        self._started = threading.Event()
        self._ended = threading.Event()
        self._taken = threading.Event()
        self._proc: subprocess.Popen[bytes] | None = None
        self._error: str | None = None
        self._code: int | None = None
        threading.Thread(target=self._run, name="planaria-node", daemon=True).start()

    def _run(self) -> None:
        """Start the agent and wait for it, on this thread (the agent's death signal follows
        it: it lives as long as the process)."""
        log_fd = None
        try:
            if self._log_dir is not None:
                try:
                    log_fd = open_node_log(Path(self._log_dir), self._node_id)
                except OSError:
                    log_fd = None  # not reachable from this Ray node: Ray's worker log has it
            self._proc = process.popen(
                self._command,
                env=self._env,
                stdin=subprocess.DEVNULL,
                stdout=log_fd,
                stderr=log_fd,
            )
        except OSError as exc:
            self._error = f"cannot start {self._command[0]}: {exc}"
            self._code = 127
            self._started.set()
            self._ended.set()
            return
        finally:
            if log_fd is not None:
                os.close(log_fd)
        self._started.set()
        proc = self._proc
        with contextlib.suppress(ChildProcessError):
            os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
        # Whatever the agent left in its group goes with it, while the group id is its own.
        process.signal_group(proc.pid, signal.SIGKILL)
        self._code = proc.wait()
        self._ended.set()
        if not self._taken.wait(self._linger):
            os._exit(0)  # nobody asked how it ended: the driver is gone

    def ready(self) -> dict[str, Any]:
        """Where the node runs, once its agent has started: the Ray node id, the machine's
        name and the agent's pid. Raises when the agent could not be started."""
        import ray

        self._started.wait()
        if self._error is not None:
            raise RuntimeError(self._error)
        assert self._proc is not None
        return {
            "ray_node": ray.get_runtime_context().get_node_id(),
            "hostname": socket.gethostname(),
            "pid": self._proc.pid,
        }

    def wait(self) -> int:
        """Block until the agent ends; its exit status (negative: killed by that signal)."""
        self._ended.wait()
        self._taken.set()
        assert self._code is not None
        return self._code

    def stop(self, grace: float) -> int | None:
        """SIGTERM the agent's group, SIGKILL it after ``grace``; its exit status."""
        self._started.wait()
        proc = self._proc
        if proc is not None and not self._ended.is_set():
            process.kill_group(proc.pid, grace)
            self._ended.wait(grace + process.KILL_WAIT)
        self._taken.set()
        return self._code
