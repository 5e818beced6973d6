"""Nothing a script starts outlives the check: timeout, cancel, and leftovers after exit."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
from custom_script_helpers import (
    MakeScript,
    make_check,
    read_pids,
    run_script,
    wait_dead,
)

from planaria.errors import HealthCheckError
from planaria.health.api import CheckContext, DeviceResult, Status
from planaria.process import group_members, running
from planaria_custom_script import process_group

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

# A leader with a child and a grandchild, all holding stdout open; each writes its pid to $PIDS.
FAMILY = """
sleep 1000 &
echo $! > "$PIDS/child"
bash -c 'sleep 1000 & echo $! > "$PIDS/grandchild"; wait' &
echo $! > "$PIDS/middle"
echo $$ > "$PIDS/leader"
echo '{"device": "gpu0", "status": "ok"}'
wait
"""


@pytest.fixture
def pids_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "pids"
    directory.mkdir()
    return directory


def _assert_all_gone(pids: dict[str, int]) -> None:
    assert set(pids) == {"leader", "child", "middle", "grandchild"}
    assert wait_dead(pids.values()) == []
    assert wait_dead(group_members(pids["leader"])) == []


@pytest.mark.parametrize("ignore_term", [False, True], ids=["dies-on-term", "needs-kill"])
def test_timeout_kills_the_whole_group(
    make_script: MakeScript, context: CheckContext, pids_dir: Path, ignore_term: bool
) -> None:
    # An ignored SIGTERM is inherited by every child: only the SIGKILL after the grace stops them.
    script = make_script(("trap '' TERM\n" if ignore_term else "") + FAMILY)
    started = time.monotonic()
    with pytest.raises(HealthCheckError) as exc:
        run_script(context, script, timeout=0.5, kill_grace=0.3, env={"PIDS": str(pids_dir)})
    elapsed = time.monotonic() - started
    assert str(exc.value) == (
        f"custom script {script} timed out after 0.5s; its process group was killed"
    )
    assert elapsed < 0.5 + 0.3 + 1.0  # the pipes held by the children did not block the read
    _assert_all_gone(read_pids(pids_dir, count=4))


def test_cancel_from_another_thread_kills_the_group(
    make_script: MakeScript, context: CheckContext, pids_dir: Path
) -> None:
    script = make_script(FAMILY)
    check = make_check(context, script, timeout=60, kill_grace=0.3, env={"PIDS": str(pids_dir)})
    outcome: list[object] = []

    def target() -> None:
        try:
            outcome.append(check.run())
        except HealthCheckError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    pids = read_pids(pids_dir, count=4)
    assert all(running(pid) for pid in pids.values())
    started = time.monotonic()
    check.cancel()
    thread.join(30)
    assert not thread.is_alive()
    assert time.monotonic() - started < 30 / 2  # the cancel ended it, not the 60 s timeout
    assert isinstance(outcome[0], HealthCheckError)
    assert "was cancelled by the check runner" in str(outcome[0])
    _assert_all_gone(pids)
    check.cancel()  # a second cancel, after the end, is harmless


def test_cancel_before_run_prevents_the_start(
    make_script: MakeScript, context: CheckContext, tmp_path: Path
) -> None:
    marker = tmp_path / "ran"
    check = make_check(context, make_script(f"touch {marker}"))
    check.cancel()
    with pytest.raises(HealthCheckError, match="cancelled before it started"):
        check.run()
    assert not marker.exists()


def test_leftovers_are_killed_when_the_script_exits(
    make_script: MakeScript, context: CheckContext, pids_dir: Path
) -> None:
    script = make_script(
        """
sleep 1000 &
echo $! > "$PIDS/straggler"
echo '{"device": "gpu0", "status": "ok"}'
exit 0
"""
    )
    started = time.monotonic()
    results = run_script(context, script, timeout=30, env={"PIDS": str(pids_dir)})
    assert time.monotonic() - started < 30 / 2  # not held until the timeout by the open pipe
    assert results == [DeviceResult(device="gpu0", status=Status.OK)]
    assert wait_dead(read_pids(pids_dir).values()) == []


def test_a_process_that_left_the_group_cannot_hang_the_check(
    make_script: MakeScript,
    context: CheckContext,
    pids_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(process_group, "DRAIN_TIMEOUT", 0.3)
    script = make_script(
        """
echo '{"device": "gpu0", "status": "ok"}'
setsid sleep 1000 &
echo $! > "$PIDS/escaped"
exit 0
"""
    )
    try:
        started = time.monotonic()
        results = run_script(context, script, timeout=30, env={"PIDS": str(pids_dir)})
        assert time.monotonic() - started < 30 / 2  # not held by the detached child
        assert results == [DeviceResult(device="gpu0", status=Status.OK)]
    finally:
        for pid in read_pids(pids_dir).values():
            os.kill(pid, signal.SIGKILL)
