"""planaria.testing.processes: a job's processes found by their mark, waited for, killed, and
a launcher run in a session of its own, on real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from planaria.testing.processes import (
    MARK,
    kill_marked,
    marked_processes,
    processes_with,
    run_group,
    wait_gone,
)

# A parent that starts a child and both sleep: the mark passes to the child through the
# environment, as it does to a job's agents and workers.
FAMILY = (
    "import subprocess, sys, time\n"
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)


def test_a_marked_family_is_found_killed_and_gone_and_nothing_else_is_touched() -> None:
    mark, other = uuid.uuid4().hex, uuid.uuid4().hex
    env = {**os.environ, MARK: mark, "EXTRA": "1"}
    parent = subprocess.Popen([sys.executable, "-c", FAMILY], env=env, stdout=subprocess.PIPE)
    bystander = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], env={**os.environ, MARK: other}
    )
    try:
        assert parent.stdout is not None and parent.stdout.readline() == b"ready\n"
        deadline = time.monotonic() + 30
        while len(found := marked_processes(mark)) < 2:  # the child may still be starting
            assert time.monotonic() < deadline, found
            time.sleep(0.05)
        assert parent.pid in found and bystander.pid not in found
        assert processes_with({f"{MARK}={mark}".encode(), b"EXTRA=1"}) == found
        assert processes_with({f"{MARK}={mark}".encode(), b"EXTRA=2"}) == []
        assert wait_gone(mark, grace=0.2) == found  # alive: returned, not waited for forever

        assert kill_marked({f"{MARK}={mark}".encode()}) is True
        parent.wait(timeout=10)  # reaped: a zombie would not count anyway
        assert wait_gone(mark, grace=10) == []
        assert kill_marked({f"{MARK}={mark}".encode()}) is False
        assert bystander.poll() is None and marked_processes(other) == [bystander.pid]
    finally:
        for proc in (parent, bystander):
            proc.kill()
            proc.wait()


def test_a_launcher_past_its_timeout_is_killed_with_its_session(tmp_path: Path) -> None:
    mark = uuid.uuid4().hex
    env = {**os.environ, MARK: mark}
    done = run_group(
        [sys.executable, "-c", "print('out'); import sys; sys.exit(3)"], tmp_path, env, 30
    )
    assert (done.returncode, done.stdout) == (3, "out\n")

    with pytest.raises(subprocess.TimeoutExpired) as caught:
        run_group([sys.executable, "-c", FAMILY], tmp_path, env, 3)
    assert "ready" in str(caught.value.stdout)
    # The child was in the launcher's session: it went with it.
    assert wait_gone(mark, grace=10) == []
