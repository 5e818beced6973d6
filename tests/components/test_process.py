"""planaria.process with real processes: the death signal, killing groups, threaded parents."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from planaria import process

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG and /proc")


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.fixture
def pids() -> Iterator[list[int]]:
    """Pids a test started outside the code under test: killed at the end, whatever happened."""
    started: list[int] = []
    yield started
    for pid in started:
        if process.running(pid):  # what passed leaves none: this is for a test that failed midway
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def python(code: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args], stdout=subprocess.PIPE, text=True
    )


# A parent with busy threads that starts `sleep` the way the caller says, prints its pid, waits.
THREADED_PARENT = """
import os, subprocess, sys, threading, time
from planaria import process

def busy():
    while True:
        sum(range(1000))
        time.sleep(0.001)

for _ in range(4):
    threading.Thread(target=busy, daemon=True).start()
how = sys.argv[1]
if how == "trampoline":
    child = process.popen(["sleep", "60"])
else:  # a Python child that sets its own death signal
    code = "import sys, time; from planaria import process; process.die_with(int(sys.argv[1])); "
    code += "print('set', flush=True); time.sleep(60)"
    child = process.popen([sys.executable, "-c", code, str(os.getpid())],
                          die_with_parent=False, stdout=subprocess.PIPE)
    assert child.stdout.readline() == b"set\\n"
print(child.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("how", ["trampoline", "in-child"])
def test_a_child_dies_when_its_threaded_parent_is_sigkilled(how: str, pids: list[int]) -> None:
    parent = python(THREADED_PARENT, how)
    pids.append(parent.pid)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    pids.append(child)
    assert process.running(child)
    assert os.getpgid(child) == child != os.getpgid(parent.pid)  # a group of its own
    if how == "trampoline":  # the pid is the command's own, not the trampoline's
        assert Path(f"/proc/{child}/cmdline").read_bytes() == b"sleep\x0060\x00"
    parent.kill()
    parent.wait()
    parent.stdout.close()
    assert wait_for(lambda: not process.running(child)), "the child outlived its SIGKILLed parent"


SHORT_THREAD_PARENT = """
import threading, time
from planaria import process

started = []
thread = threading.Thread(target=lambda: started.append(process.popen(["sleep", "60"])))
thread.start()
thread.join()
print(started[0].pid, flush=True)
time.sleep(60)
"""


def test_the_death_signal_follows_the_thread_that_started_the_child(pids: list[int]) -> None:
    # What the module docstring warns of: the kernel watches the forking thread, not the process.
    parent = python(SHORT_THREAD_PARENT)
    pids.append(parent.pid)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    pids.append(child)
    assert wait_for(lambda: not process.running(child))
    assert parent.poll() is None
    parent.kill()
    parent.wait()
    parent.stdout.close()


def test_die_with_a_parent_already_gone_dies_at_once() -> None:
    # Its real parent is this test, not pid 1: as if the parent died before the prctl.
    code = "from planaria import process; process.die_with(1); print('survived')"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == -signal.SIGKILL
    assert result.stdout == ""


# --- killing a group ------------------------------------------------------------------------

# The leader starts a child that starts a grandchild ignoring SIGTERM; all write their pids.
FAMILY = """
import json, os, signal, subprocess, sys, time
out = sys.argv[1]
if len(sys.argv) == 2:
    child = subprocess.Popen([sys.executable, __file__, out, "child"])
elif sys.argv[2] == "child":
    subprocess.Popen([sys.executable, __file__, out, "grandchild"])
else:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(os.path.join(out, sys.argv[2] if len(sys.argv) > 2 else "leader"), "w") as f:
    f.write(str(os.getpid()))
time.sleep(60)
"""


def _family(tmp_path: Path) -> tuple[subprocess.Popen[bytes], dict[str, int]]:
    script = tmp_path / "family.py"
    script.write_text(FAMILY)
    leader = process.popen([sys.executable, str(script), str(tmp_path)])
    names = ("leader", "child", "grandchild")
    assert wait_for(lambda: all((tmp_path / n).exists() for n in names))
    time.sleep(0.05)  # the grandchild wrote its pid after setting SIG_IGN
    return leader, {n: int((tmp_path / n).read_text()) for n in names}


def test_kill_group_ends_a_grandchild_that_ignores_sigterm_after_the_grace(
    tmp_path: Path, pids: list[int]
) -> None:
    leader, family = _family(tmp_path)
    pids.extend(family.values())
    assert {os.getpgid(pid) for pid in family.values()} == {leader.pid}
    grace = 0.5
    started = time.monotonic()
    assert process.kill_group(leader.pid, grace) is True
    assert time.monotonic() - started >= grace  # the grandchild held it: SIGKILL after the grace
    assert not any(process.running(pid) for pid in family.values())
    assert leader.wait() == -signal.SIGTERM  # the leader itself obeyed SIGTERM
    assert process.live_groups([leader.pid]) == set()


def test_kill_group_does_not_wait_out_the_grace_when_all_obey(
    tmp_path: Path, pids: list[int]
) -> None:
    leader = process.popen([sys.executable, "-c", "import time; time.sleep(60)"])
    pids.append(leader.pid)
    grace = 30.0
    started = time.monotonic()
    assert process.kill_group(leader.pid, grace)
    assert time.monotonic() - started < grace / 2
    assert leader.wait() == -signal.SIGTERM


def test_a_stopped_process_handles_sigterm_before_any_sigkill(tmp_path: Path) -> None:
    mark = tmp_path / "handled"
    code = f"""
    import signal, sys, time
    def bye(*_):
        open({str(mark)!r}, "w").close()
        sys.exit(0)
    signal.signal(signal.SIGTERM, bye)
    print("ready", flush=True)
    time.sleep(60)
    """
    leader = process.popen(
        [sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True
    )
    assert leader.stdout is not None and leader.stdout.readline() == "ready\n"
    os.kill(leader.pid, signal.SIGSTOP)
    grace = 30.0
    started = time.monotonic()
    assert process.kill_group(leader.pid, grace)
    assert time.monotonic() - started < grace / 2  # SIGCONT let it act on the SIGTERM
    assert leader.wait() == 0 and mark.exists()
    leader.stdout.close()


def test_kill_groups_gives_one_grace_to_all(tmp_path: Path, pids: list[int]) -> None:
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    leaders = [process.popen([sys.executable, "-c", code]) for _ in range(3)]
    pids.extend(p.pid for p in leaders)
    time.sleep(0.3)  # past the interpreter's start: SIGTERM is ignored by now
    grace = 1.0
    started = time.monotonic()
    assert process.kill_groups([p.pid for p in leaders], grace) == set()
    assert grace <= time.monotonic() - started < 3 * grace  # one grace for three, not three
    assert [p.wait() for p in leaders] == [-signal.SIGKILL] * 3


def test_a_zombie_is_not_a_live_member(pids: list[int]) -> None:
    proc = process.popen(["true"])
    pids.append(proc.pid)
    assert wait_for(lambda: process.has_exited(proc.pid))
    os.killpg(proc.pid, 0)  # the unreaped leader still holds its group
    assert process.live_groups([proc.pid]) == set()
    assert proc.wait() == 0
    with pytest.raises(ChildProcessError):
        process.has_exited(proc.pid)


def test_proc_stat_reads_a_process_whose_name_holds_spaces_and_parentheses(
    tmp_path: Path, pids: list[int]
) -> None:
    """The command name sits between the pid and the state in ``/proc/PID/stat`` and may
    hold ") (": the fields are counted from its end."""
    odd = tmp_path / "a) (b c"
    odd.symlink_to(sys.executable)
    proc = process.popen([str(odd), "-c", "import time; time.sleep(30)"])
    pids.append(proc.pid)
    stat = process.proc_stat(proc.pid)
    assert stat is not None
    assert Path(f"/proc/{proc.pid}/comm").read_text().strip() == "a) (b c"
    assert stat.ppid == os.getpid() and stat.pgrp == proc.pid  # a group of its own
    assert stat.state in ("R", "S") and not stat.exited and process.running(proc.pid)
    assert int(stat.start_time) > 0
    assert proc.pid in process.group_members(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    assert wait_for(lambda: process.has_exited(proc.pid))
    zombie = process.proc_stat(proc.pid)
    assert zombie is not None and zombie.state == "Z" and zombie.exited
    assert not process.running(proc.pid) and process.group_members(proc.pid) == []
    proc.wait()
    assert process.proc_stat(proc.pid) is None and not process.running(proc.pid)


# --- starting -------------------------------------------------------------------------------


def _not_a_program(tmp_path: Path) -> list[str]:
    script = tmp_path / "no-shebang"
    script.write_text("echo hi\n")
    script.chmod(0o755)
    return [str(script)]


@pytest.mark.parametrize(
    "argv",
    [
        lambda tmp: ["/nonexistent/program"],
        lambda tmp: ["no-such-program-on-path-xyz"],
        lambda tmp: [str(tmp)],  # a directory
        _not_a_program,  # ENOEXEC
    ],
    ids=["missing", "not-on-path", "directory", "no-shebang"],
)
def test_an_exec_failure_raises_what_popen_raises(
    tmp_path: Path, argv: Callable[[Path], list[str]]
) -> None:
    command = argv(tmp_path)
    with pytest.raises(OSError) as expected:
        subprocess.Popen(command)
    with pytest.raises(OSError) as got:
        process.popen(command)
    assert type(got.value) is type(expected.value)
    assert (got.value.errno, got.value.filename) == (expected.value.errno, command[0])

    async def spawn() -> None:
        await process.spawn(command)

    with pytest.raises(type(expected.value)):
        asyncio.run(spawn())


def test_spawn_starts_the_command_itself_with_its_env(tmp_path: Path) -> None:
    async def main() -> tuple[int, bytes]:
        proc = await process.spawn(
            ["sh", "-c", "echo $$ $PLANARIA_TEST_VALUE"],
            env={"PATH": os.environ["PATH"], "PLANARIA_TEST_VALUE": "42"},
            cwd=tmp_path,
            stdout=asyncio.subprocess.PIPE,
        )
        out, _ = await proc.communicate()
        return proc.pid, out

    pid, out = asyncio.run(main())
    assert out.split() == [str(pid).encode(), b"42"]


def test_refuses_arguments_that_would_break_its_promise() -> None:
    with pytest.raises(TypeError, match=r"preexec_fn=.*unsafe in a threaded process"):
        process.popen(["true"], preexec_fn=lambda: None)
    with pytest.raises(TypeError, match="shell"):
        process.popen(["true"], shell=True)
    with pytest.raises(ValueError, match="empty"):
        process.popen([])


# The work of a busy multi-threaded parent while its main thread starts processes.
MANY_THREADS = """
import logging, sys, threading
from planaria import process

logging.basicConfig(filename=sys.argv[1], level=logging.INFO)
log = logging.getLogger("busy")
stop = threading.Event()

def busy(n):
    while not stop.is_set():
        junk = [bytearray(4096) for _ in range(64)]
        log.info("thread %d holds %d buffers", n, len(junk))
        __import__("json").dumps({"n": n})

threads = [threading.Thread(target=busy, args=(n,)) for n in range(8)]
for t in threads:
    t.start()
codes = []
for i in range(50):
    codes.append(process.popen([sys.executable, "-I", "-S", "-c", "pass"]).wait())
stop.set()
for t in threads:
    t.join()
print(sum(1 for c in codes if c == 0), flush=True)
"""


@pytest.mark.slow
def test_starting_from_a_parent_with_many_busy_threads_does_not_deadlock(tmp_path: Path) -> None:
    try:
        result = subprocess.run(
            [sys.executable, "-c", MANY_THREADS, str(tmp_path / "log")],
            capture_output=True,
            text=True,
            timeout=300,
        )
    except subprocess.TimeoutExpired:  # pragma: no cover - what a deadlock looks like
        pytest.fail("starting processes from a threaded parent hung")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "50"
    assert "thread 7 holds 64 buffers" in (tmp_path / "log").read_text()


def test_loads_by_path_without_the_package_or_heavy_modules() -> None:
    # The zygote loads it so: its workers must start with a fresh interpreter's modules.
    path = Path(process.__file__).resolve()
    code = f"""
    import importlib.util, json, sys
    spec = importlib.util.spec_from_file_location("_p", {str(path)!r})
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    heavy = ("planaria", "subprocess", "asyncio", "threading")
    print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in heavy)))
    """
    result = subprocess.run(
        [sys.executable, "-I", "-c", textwrap.dedent(code)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []
