"""Runs a tool (npu-smi, the torch_npu probe) as an argv list, in its own process group, with a
timeout. Whatever the tool starts is killed with it: a check leaves no process behind."""

from __future__ import annotations

import signal
import subprocess
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from planaria.errors import HealthCheckError
from planaria.process import popen, signal_group


@dataclass(frozen=True)
class Outcome:
    returncode: int
    stdout: str
    stderr: str

    def tail(self, limit: int = 400) -> str:
        """The end of stderr, else of stdout, on one line: what a message quotes."""
        text = " ".join((self.stderr.strip() or self.stdout.strip()).split())
        return text if len(text) <= limit else "..." + text[-limit:]


class CommandTimeout(HealthCheckError):
    """The command ran past its timeout; its process group was killed."""


class CommandCancelled(HealthCheckError):
    """The check was cancelled while the command ran; its process group was killed."""


class Runner:
    """Runs one command at a time and can kill it from another thread (:meth:`cancel`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._cancelled = False

    def run(
        self, argv: Sequence[str], timeout: float, env: Mapping[str, str] | None = None
    ) -> Outcome:
        """Run ``argv`` (never through a shell). Raises ``OSError`` when it cannot start,
        :class:`CommandTimeout` past ``timeout`` seconds."""
        with self._lock:
            if self._cancelled:
                raise CommandCancelled(f"{argv[0]} was not started: the check was cancelled")
            # It dies with this thread, which waits for it: a killed agent leaves no tool.
            process = popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=None if env is None else dict(env),
            )
            self._process = process
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            signal_group(process.pid, signal.SIGKILL)
            process.communicate()
            raise CommandTimeout(
                f"{' '.join(argv)} did not finish within {timeout:g}s; it was killed"
            ) from None
        finally:
            # Children it left running die with it, whatever happened.
            signal_group(process.pid, signal.SIGKILL)
            with self._lock:
                self._process = None
        if self._cancelled:
            raise CommandCancelled(f"{' '.join(argv)} was killed: the check was cancelled")
        return Outcome(
            process.returncode,
            stdout.decode("utf-8", errors="replace"),
            stderr.decode("utf-8", errors="replace"),
        )

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            process = self._process
        if process is not None:
            signal_group(process.pid, signal.SIGKILL)
