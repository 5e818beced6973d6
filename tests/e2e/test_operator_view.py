"""What an operator reads: ``planaria run`` piped into a CI log, and the job's processes."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import textwrap

import structlog

from planaria import log
from planaria.testing.jobs import job, planaria_command

STAMP = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"

NO_STEP = """
    import os, sys
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        print("the first attempt fails on purpose", file=sys.stderr)
        sys.exit(3)
    print("done, without ever reporting a step")
"""


def test_a_piped_run_prints_whole_rows_and_says_why_steps_are_unknown(tmp_path, mark):
    script = tmp_path / "no_step.py"
    script.write_text(textwrap.dedent(NO_STEP))
    config = job(tmp_path, job={"nodes": 1, "procs_per_node": 1, "max_restarts": 1})
    argv, env = planaria_command(mark, (str(config), "--", sys.executable, str(script)))
    env["COLUMNS"] = "40"  # narrow, and stdout is a pipe: rich would fold every cell
    result = subprocess.run(
        argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()

    # Each row of the summary and of the faults table is one line, whatever COLUMNS says.
    (fault,) = [line for line in lines if line.startswith("│ worker_failed ")]
    assert "rank 0 (node node-0) exit code 3" in fault
    assert "restart workers in place" in fault

    # No step was ever reported: the steps and the goodput are unknown, and the summary says
    # why and what to call, instead of "0" and "100%".
    (steps,) = [line for line in lines if "steps done" in line]
    assert (
        "unknown: the training command never reported a step: call planaria.monitor.step(n) "
        "or Checkpointer.save" in steps
    )
    (goodput,) = [line for line in lines if "goodput" in line]
    assert "unknown" in goodput and "%" not in goodput

    # One time format on the console: job events (stdout) and log entries (stderr) alike.
    events = [line for line in lines if re.search(r" (job_started|fault_detected) ", line)]
    logged = [line for line in result.stderr.splitlines() if "[info" in line]
    assert len(events) == 2 and logged
    for line in events + logged:
        assert re.match(STAMP + r" ", line), line


def test_json_logs_keep_their_timestamps_and_the_console_uses_milliseconds() -> None:
    stream = io.StringIO()
    try:
        log.configure("json", stream=stream)
        log.get_logger("test").info("one entry")
        log.configure("console", stream=stream)
        log.get_logger("test").info("another entry")
    finally:
        structlog.reset_defaults()
    as_json, console = stream.getvalue().splitlines()
    stamp = json.loads(as_json)["timestamp"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", stamp), stamp
    assert re.match(STAMP + r" \[info\s*\] another entry", console), console
    assert log.timestamp(1.9996) == "1970-01-01T00:00:01.999Z"  # cut, never rounded up
