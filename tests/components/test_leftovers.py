"""planaria.leftovers with real processes: what escaped its session is found by its marker."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from planaria import leftovers

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="/proc")

# Double fork with a setsid between, ignore SIGTERM, print the grandchild's pid, sleep: what a
# daemon, or a launcher's worker whose launcher died, looks like.
ESCAPE = """
import os, signal, sys, time
if os.fork():
    os._exit(0)
os.setsid()
if os.fork():
    os._exit(0)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print(os.getpid(), flush=True)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


@pytest.fixture
def pids() -> Iterator[list[int]]:
    """Pids a test started: killed at the end whatever happened (when it passed, none is left)."""
    started: list[int] = []
    yield started
    for pid in started:
        if alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def escaped(env: dict[str, str], pids: list[int]) -> int:
    """Start ESCAPE with ``env``; the grandchild's pid, once its launcher has exited."""
    launcher = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(ESCAPE)], env=env, stdout=subprocess.PIPE, text=True
    )
    assert launcher.stdout is not None
    pid = int(launcher.stdout.readline())
    pids.append(pid)
    launcher.stdout.close()
    assert launcher.wait(timeout=10) == 0
    return pid


def sleeper(env: dict[str, str], pids: list[int]) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(["sleep", "600"], env=env)
    pids.append(proc.pid)
    return proc


def test_a_setsid_double_forked_sigterm_ignoring_grandchild_is_found_and_killed(
    pids: list[int],
) -> None:
    marker = leftovers.new_marker()
    grandchild = escaped(leftovers.marked(os.environ, marker), pids)
    stranger = sleeper(leftovers.unmarked(os.environ), pids)
    other = sleeper(leftovers.marked(os.environ, leftovers.new_marker()), pids)

    found = leftovers.survivors(marker)
    assert [s.pid for s in found] == [grandchild]
    assert found[0].ppid != os.getpid()  # it left us: reparented
    assert os.getsid(grandchild) != os.getsid(0)  # and in a session of its own
    assert "time.sleep(600)" in found[0].cmdline

    killed = leftovers.kill_survivors(marker, grace=0.2)
    assert [s.pid for s in killed] == [grandchild]
    assert not alive(grandchild)
    assert leftovers.survivors(marker) == []
    assert stranger.poll() is None and other.poll() is None  # without the marker: untouched
    for proc in (stranger, other):
        proc.kill()
        proc.wait()


def test_a_parent_forking_while_it_dies_leaves_no_child(pids: list[int]) -> None:
    """Each look finds children forked since the last one: killing goes on until none."""
    marker = leftovers.new_marker()
    code = "import os, time\nwhile True:\n    os.fork() or time.sleep(600)\n    time.sleep(0.002)"
    forker = subprocess.Popen(
        [sys.executable, "-c", code],
        env=leftovers.marked(os.environ, marker),
        start_new_session=True,
    )
    pids.append(forker.pid)
    deadline = time.monotonic() + 10
    while len(leftovers.survivors(marker)) < 20 and time.monotonic() < deadline:
        time.sleep(0.02)
    killed = leftovers.kill_survivors(marker)
    forker.wait(timeout=10)
    assert len(killed) >= 20
    assert leftovers.survivors(marker) == []
    assert not any(alive(s.pid) for s in killed)


def test_a_process_exiting_within_the_grace_is_not_a_survivor(pids: list[int]) -> None:
    marker = leftovers.new_marker()
    proc = subprocess.Popen(["sleep", "0.3"], env=leftovers.marked(os.environ, marker))
    pids.append(proc.pid)
    assert [s.pid for s in leftovers.survivors(marker)] == [proc.pid]
    # Our own child turns zombie at its exit, which no longer counts: no need to reap it first.
    assert leftovers.kill_survivors(marker, grace=10) == []
    assert proc.wait(timeout=1) == 0  # it ended by itself, not by SIGKILL


def test_markers_nest_and_excluded_pids_are_spared(pids: list[int]) -> None:
    outer, inner = leftovers.new_marker(), leftovers.new_marker()
    env = leftovers.marked(leftovers.marked(os.environ, outer), inner)
    assert leftovers.markers_in(env)[-2:] == [outer, inner]
    proc = sleeper(env, pids)
    assert [s.pid for s in leftovers.survivors(outer)] == [proc.pid]
    assert [s.pid for s in leftovers.survivors([inner, "unused"])] == [proc.pid]
    assert leftovers.survivors(outer, exclude=[proc.pid]) == []
    assert leftovers.kill_survivors(inner, exclude={proc.pid}) == []
    assert proc.poll() is None
    assert [s.pid for s in leftovers.kill_survivors(outer)] == [proc.pid]
    assert proc.wait(timeout=5) == -signal.SIGKILL
    assert leftovers.markers_in(leftovers.unmarked(env, inner))[-1] == outer
    assert leftovers.VARIABLE not in leftovers.unmarked(env)


def test_marking_sets_os_environ_for_the_block_only() -> None:
    before = os.environ.get(leftovers.VARIABLE)
    with leftovers.marking() as marker:
        assert leftovers.markers_in(os.environ)[-1] == marker
        child = subprocess.run(
            [sys.executable, "-c", f"import os; print(os.environ['{leftovers.VARIABLE}'])"],
            capture_output=True,
            text=True,
            check=True,
        )
        assert child.stdout.strip().split(",")[-1] == marker
    assert os.environ.get(leftovers.VARIABLE) == before


@pytest.mark.parametrize("bad", ["", "a,b", "a=b", " a", "a\0b"])
def test_a_bad_marker_is_refused_saying_why(bad: str) -> None:
    with pytest.raises(ValueError, match="PLANARIA_TRACE marker must be"):
        leftovers.marked({}, bad)
    with pytest.raises(ValueError, match="PLANARIA_TRACE marker must be"):
        leftovers.survivors(bad)


def test_the_sweeper_reports_what_a_trial_left_and_checks_at_the_end(pids: list[int]) -> None:
    said: list[str] = []
    sweeper = leftovers.Sweeper(grace=0.2, report=said.append)
    with sweeper.trial("clean trial"):
        subprocess.run(["true"], check=True)
    assert said == []
    with sweeper.trial("leaky trial"):
        grandchild = escaped(dict(os.environ), pids)
    assert not alive(grandchild)
    assert [s.pid for s in sweeper.killed] == [grandchild]
    assert len(said) == 1 and "leaky trial left 1 process(es)" in said[0]
    assert f"pid {grandchild}" in said[0]
    assert sweeper.final() == []
    assert "left behind: nothing" in said[-1] and "2 trials" in said[-1]


def test_a_sweeper_left_by_an_error_still_makes_its_last_check() -> None:
    said: list[str] = []
    with (
        pytest.raises(RuntimeError, match="the benchmark failed"),
        leftovers.Sweeper(grace=0.1, report=said.append) as sweeper,
    ):
        with sweeper.trial("a trial"):
            subprocess.run(["true"], check=True)
        raise RuntimeError("the benchmark failed")
    assert said == [
        "left behind: nothing (no process of the 1 trials is alive; 0 killed after their trial)"
    ]
    with leftovers.Sweeper(report=said.append) as sweeper:
        with sweeper.trial("another"):
            pass
        sweeper.final()
    assert len(said) == 2  # made once, not again on the way out
