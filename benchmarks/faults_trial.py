"""One trial of the fault suite (benchmarks/faults.py): a ``planaria run`` watched from outside.

The run has a session of its own and every process it starts carries a mark in its environment
(``PLANARIA_FAULTS_MARK``): the local scheduler puts each node in a session of its own, and a
node may outlive ``planaria run`` (a master killed on purpose), so killing one process group is
not enough to end a trial. At the end every marked process is SIGKILLed and the run's files in
/dev/shm are removed; what the job left behind after it ended on its own is reported.

A fault that no chaos rule injects is driven by a *driver*: a function given the running
:class:`Trial` in a thread of its own. It waits on the timeline (``events.jsonl``) or the
processes of the job, does its damage, and returns a note saying what it did.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

MARK = "PLANARIA_FAULTS_MARK"
SHM = Path("/dev/shm")
STEP_LINE = "step "

T = TypeVar("T")
Event = dict[str, Any]
Driver = Callable[["Trial"], str]


class TrialOver(Exception):
    """The job ended, or the trial ran out of time, before what a driver waited for."""


@dataclass(frozen=True)
class Proc:
    pid: int
    argv: list[str]
    node: str | None
    """``PLANARIA_NODE_ID`` of its environment: the node it belongs to."""

    @property
    def is_agent(self) -> bool:
        return self.argv[1:4] == ["-m", "planaria", "agent"]

    @property
    def is_persister(self) -> bool:
        return "planaria.checkpoint.persister" in self.argv


@dataclass
class Outcome:
    work: Path
    returncode: int | None
    """None: the trial ran out of time and was killed."""
    console: str
    events: list[Event]
    run_dir: Path | None
    left_behind: list[str] = field(default_factory=list)
    """Processes alive and /dev/shm files present a few seconds after the job ended."""
    driver_note: str = ""
    driver_error: str = ""

    def of(self, kind: str) -> list[Event]:
        return [e for e in self.events if e["kind"] == kind]

    @property
    def succeeded(self) -> bool:
        return self.returncode == 0 and bool(self.of("job_finished"))

    @property
    def failure(self) -> str:
        """Why the job did not succeed, in a few words."""
        if self.driver_error:
            return f"the fault could not be driven: {self.driver_error}"
        if self.returncode is None:
            return "timed out"
        stopped = self.of("job_stopped")
        if stopped:
            return f"job stopped: {stopped[-1]['message'][:160]}"
        tail = self.console.strip().splitlines()[-1:] or ["no output"]
        return f"exit {self.returncode}: {tail[0][:160]}"

    def recovery(self) -> tuple[int, float]:
        """Steps lost and recovery time, from the master's ``recovered`` events: the largest of
        each (the failures one fault causes, a worker and its peers, recover together)."""
        recovered = [e["data"] for e in self.of("recovered")]
        lost = max((d.get("steps_lost") or 0 for d in recovered), default=0)
        seconds = max((float(d["recovery_s"]) for d in recovered), default=0.0)
        return int(lost), round(seconds, 2)

    def log(self, name: str) -> str:
        """A log of the run (``rank-0.log``, ``agents/node-1.log``), empty if there is none."""
        if self.run_dir is None:
            return ""
        path = self.run_dir / "logs" / name
        return path.read_text(errors="replace") if path.exists() else ""


class Trial:
    """``argv`` (a ``planaria run``) in ``work``, for at most ``timeout`` seconds."""

    def __init__(self, work: Path, argv: list[str], env: dict[str, str], timeout: float) -> None:
        self.work = work
        self.argv = argv
        self.mark = uuid.uuid4().hex
        self.env = {**env, MARK: self.mark}
        self.timeout = timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self._launched: list[subprocess.Popen[bytes]] = []
        self._over = threading.Event()
        self._lock = threading.Lock()
        self._relaunching = False
        self._deadline = 0.0

    # -- what a driver sees ---------------------------------------------------------------

    @property
    def run_dir(self) -> Path | None:
        return next(iter(sorted(self.work.glob("planaria-runs/*/"))), None)

    def events(self) -> list[Event]:
        run_dir = self.run_dir
        path = None if run_dir is None else run_dir / "events.jsonl"
        if path is None or not path.exists():
            return []
        lines = path.read_text(errors="replace").splitlines()
        return [json.loads(line) for line in lines if line.endswith("}")]

    def wait_for(self, what: str, probe: Callable[[], T | None], interval: float = 0.02) -> T:
        """The first value of ``probe()`` that is not None; :class:`TrialOver` if the job ends
        or the trial's time runs out first (``what`` says what was awaited)."""
        while True:
            found = probe()
            if found is not None:
                return found
            if self._over.is_set() or time.monotonic() > self._deadline:
                raise TrialOver(f"the job ended before {what}")
            time.sleep(interval)

    def event(self, what: str, match: Callable[[Event], bool]) -> Event:
        return self.wait_for(what, lambda: next((e for e in self.events() if match(e)), None))

    def step(self) -> int:
        """The newest step rank 0 logged (-1 before the first)."""
        run_dir = self.run_dir
        log = None if run_dir is None else run_dir / "logs" / "rank-0.log"
        if log is None or not log.exists():
            return -1
        steps = [
            int(line.split()[1])
            for line in log.read_text(errors="replace").splitlines()
            if line.startswith(STEP_LINE) and line.split()[1].isdigit()
        ]
        return max(steps, default=-1)

    def node_of_rank(self, node_rank: int) -> str:
        """The node holding ``node_rank`` in the newest round."""

        def probe() -> str | None:
            rounds = [e for e in self.events() if e["kind"] == "rendezvous_completed"]
            ranks: dict[str, int] = rounds[-1]["data"]["ranks"] if rounds else {}
            return next((node for node, rank in ranks.items() if rank == node_rank), None)

        return self.wait_for(f"a round gave out node rank {node_rank}", probe)

    def processes(self) -> list[Proc]:
        """The live processes of this trial."""
        return list(_marked(self.mark))

    def agent(self, node: str) -> Proc:
        return self.wait_for(
            f"the agent of {node} ran",
            lambda: next((p for p in self.processes() if p.is_agent and p.node == node), None),
        )

    def persister(self, node: str) -> Proc:
        return self.wait_for(
            f"the persister of {node} ran",
            lambda: next((p for p in self.processes() if p.is_persister and p.node == node), None),
        )

    def relaunch(self, argv: list[str]) -> None:
        """SIGKILL ``planaria run`` (the master) and start ``argv`` in its place; the job's
        other processes are left as they are."""
        with self._lock:
            assert self.proc is not None
            self._relaunching = True
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.proc = self._launch(argv)
            self._relaunching = False

    # -- running it -----------------------------------------------------------------------

    def run(self, driver: Driver | None = None) -> Outcome:
        self._deadline = time.monotonic() + self.timeout
        note, error = "", ""

        def drive() -> None:
            nonlocal note, error
            assert driver is not None
            try:
                note = driver(self)
            except TrialOver as exc:
                error = str(exc)
            except Exception as exc:  # a driver's bug is the row's note, not a crash
                error = f"{type(exc).__name__}: {exc}"

        self.proc = self._launch(self.argv)
        thread = threading.Thread(target=drive, daemon=True) if driver else None
        if thread is not None:
            thread.start()
        timed_out = False
        try:
            while True:
                with self._lock:
                    code = None if self._relaunching else self.proc.poll()
                if code is not None:
                    break
                if time.monotonic() > self._deadline:
                    timed_out = True
                    break
                time.sleep(0.05)
        finally:
            self._over.set()
            if thread is not None:
                thread.join(timeout=10)
            left = self._end(timed_out)
        console = (self.work / "console.log").read_text(errors="replace")
        return Outcome(
            work=self.work,
            returncode=None if timed_out else self.proc.returncode,
            console=console,
            events=self.events(),
            run_dir=self.run_dir,
            left_behind=left,
            driver_note=note,
            driver_error=error,
        )

    def _launch(self, argv: list[str]) -> subprocess.Popen[bytes]:
        with open(self.work / "console.log", "ab") as console:
            proc = subprocess.Popen(
                argv,
                cwd=self.work,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=console,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._launched.append(proc)
        return proc

    def _end(self, timed_out: bool) -> list[str]:
        """Kill what is left of the trial; what the job left after it ended on its own."""
        left: list[str] = []
        if not timed_out:  # the job ended: give its processes a moment to follow it
            deadline = time.monotonic() + 5
            while _any(self.mark) and time.monotonic() < deadline:
                time.sleep(0.1)
            left += [f"pid {p.pid} ({' '.join(p.argv[:4])})" for p in _marked(self.mark)]
        for proc in self._launched:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while (alive := list(_marked(self.mark))) and time.monotonic() < deadline:
            for p in alive:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
            time.sleep(0.1)
        if alive:
            left += [f"pid {p.pid} survived SIGKILL" for p in alive]
        left += self._clean_shm(wait=not timed_out)
        return left

    def _clean_shm(self, wait: bool) -> list[str]:
        """Remove the run's node directories in /dev/shm; the names of those still there a
        moment after the job ended (each node's persister removes its own)."""
        started = [e for e in self.events() if e["kind"] == "job_started"]
        if not started:
            return []
        from planaria.shm import name_prefix  # here: the suite's refusals need no planaria

        prefix = f"{name_prefix()}{started[0]['data']['run_id']}-"
        deadline = time.monotonic() + (5 if wait else 0)
        while (found := sorted(SHM.glob(f"{prefix}*"))) and time.monotonic() < deadline:
            time.sleep(0.1)
        for path in found:
            shutil.rmtree(path, ignore_errors=True)
        return [f"{path} (removed)" for path in found]


def _marked(mark: str) -> list[Proc]:
    """Every live (not zombie) process whose environment carries ``mark``."""
    from planaria.testing.processes import environ_of, processes_with

    found = []
    for pid in processes_with({f"{MARK}={mark}".encode()}):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        node = next(
            (
                e.split(b"=", 1)[1].decode()
                for e in environ_of(pid)
                if e.startswith(b"PLANARIA_NODE_ID=")
            ),
            None,
        )
        found.append(Proc(pid, [a for a in argv if a], node))
    return found


def _any(mark: str) -> bool:
    return bool(_marked(mark))


def open_files(pid: int) -> list[str]:
    """The paths ``pid`` has open (empty once it is gone)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    paths = []
    for fd in fds:
        with contextlib.suppress(OSError):
            paths.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return paths
