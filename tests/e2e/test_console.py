"""The workers' output on the ``planaria run`` console: rank prefixes, torchrun's
``--redirects``/``--tee``/``--local-ranks-filter``/``--log-dir``, restart marks in the rank logs
and a failed rank's last lines in the summary.

The end-to-end tests run the real ``planaria run`` (master, agents, workers) on the local
scheduler with small scripts.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from planaria.agent.console import ConsoleBuffer, batches, console_streams, prefix
from planaria.agent.worker_logs import LogLimits, LogPump, Source
from planaria.config import load_raw, read
from planaria.config.job import LogsSection
from planaria.errors import ConfigError
from planaria.master.summary import tail_of
from planaria.protocol import JobSpec
from planaria.testing.jobs import run


def texts(buffer: ConsoleBuffer) -> tuple[list[tuple[int, str, str]], int]:
    lines, dropped = buffer.take()
    return [(line.rank, line.stream, line.text) for line in lines], dropped


# -- what the console shows of a pipe -------------------------------------------------------------


def test_lines_are_whole_and_a_line_cut_between_reads_is_one_line():
    buffer = ConsoleBuffer()
    buffer.feed("a", 0, "output", b"one\ntw")
    buffer.feed("b", 1, "stderr", b"other\r")
    buffer.feed("a", 0, "output", b"o\r\nthree")
    buffer.feed("b", 1, "stderr", b"\nnext\n")  # \r\n cut between two reads: one line end
    assert texts(buffer) == (
        [
            (0, "output", "one"),
            (0, "output", "two"),
            (1, "stderr", "other"),  # its \r waited for the next read: the line ended there
            (1, "stderr", "next"),
        ],
        0,
    )
    buffer.end("a", 0, "output")  # the pipe ended: its unfinished line is a line
    assert texts(buffer) == ([(0, "output", "three")], 0)


def test_a_progress_bar_shows_its_latest_state_not_every_redraw():
    buffer = ConsoleBuffer()
    for i in range(100):
        buffer.feed("bar", 2, "output", f"\r{i}%   ".encode())
    buffer.feed("log", 3, "output", b"elsewhere\n")
    buffer.feed("bar", 2, "output", b"\rdone\n")
    assert texts(buffer) == ([(2, "output", "done"), (3, "output", "elsewhere")], 0)


def test_a_full_buffer_drops_lines_and_counts_them_and_a_long_line_is_cut():
    buffer = ConsoleBuffer(max_bytes=1 << 20, max_lines=3)
    buffer.feed("a", 0, "output", b"1\n2\n3\n4\n5\n")
    assert texts(buffer) == ([(0, "output", s) for s in "123"], 2)
    assert texts(buffer) == ([], 0)  # counted once
    buffer = ConsoleBuffer(max_bytes=20_000, max_lines=100)
    buffer.feed("a", 0, "output", b"x" * 20_000)  # no line end, longer than a line may be
    lines, dropped = texts(buffer)
    assert [len(text) for _, _, text in lines] == [8192, 8192] and dropped == 0
    buffer.give_back(5)
    assert texts(buffer)[1] == 5


def test_output_past_the_bound_is_dropped_whole_lines_at_a_time_and_counted():
    buffer = ConsoleBuffer(max_bytes=10)
    buffer.feed("a", 0, "output", b"abc\nde")
    buffer.feed("a", 0, "output", b"f\ng\n")  # 10 bytes pending: the bound
    buffer.feed("a", 0, "output", b"h\ni\n")  # over it: two lines lost
    assert texts(buffer) == ([(0, "output", s) for s in ("abc", "def", "g")], 2)
    # A line cut by a drop is lost whole: neither its start nor its rest is shown.
    buffer.feed("a", 0, "output", b"jklmnopq")
    buffer.feed("a", 0, "output", b"rst\nu\nvw")  # dropped: ends mid-line
    assert texts(buffer) == ([], 2)  # "jklmnopqrst" and "u"
    buffer.feed("a", 0, "output", b"xy\nz\n")  # "vwxy" is the rest of a lost line
    assert texts(buffer) == ([(0, "output", "z")], 1)
    buffer.feed("b", 1, "output", b"0123456789")
    buffer.feed("b", 1, "output", b"\n")  # dropped: it ended the line
    buffer.end("b", 1, "output")
    assert texts(buffer) == ([], 1)  # the pipe's end shows no half line
    buffer.feed("c", 2, "output", b"more")
    buffer.feed("c", 2, "output", b"\n")
    buffer.end("c", 2, "output")
    assert texts(buffer) == ([(2, "output", "more")], 0)


def test_pending_lines_go_in_requests_of_bounded_size_in_order():
    buffer = ConsoleBuffer()
    buffer.feed("a", 0, "output", b"".join(b"%06d" % i + b"x" * 994 + b"\n" for i in range(1000)))
    lines, _ = buffer.take()
    parts = batches(lines, limit=100_000)
    assert [line for part in parts for line in part] == lines
    assert all(sum(len(line.text) + 16 for line in part) <= 100_000 for part in parts)
    assert len(parts) == 11 and batches([]) == []


def test_a_worker_never_waits_for_a_console_that_takes_nothing(tmp_path):
    """Nobody takes the console's lines: the pipe still drains at full speed into the log,
    and the console keeps what fits and counts the rest."""
    buffer = ConsoleBuffer(max_bytes=1 << 20, max_lines=100)
    pump = LogPump(LogLimits(), buffer)
    path = tmp_path / "rank-0.log"
    try:
        fd = pump.pipe(path, Source(0))
        with os.fdopen(fd, "wb") as pipe:  # blocking writes: they return only once read
            for i in range(50_000):
                pipe.write(b"line %d\n" % i)
        deadline = time.monotonic() + 30
        while path.stat().st_size < sum(len(b"line %d\n" % i) for i in range(50_000)):
            assert time.monotonic() < deadline, path.stat().st_size
            time.sleep(0.01)
        pump.drain(path)
    finally:
        pump.close()
    assert path.read_text().splitlines()[-1] == "line 49999"
    lines, dropped = texts(buffer)
    assert [text for _, _, text in lines] == [f"line {i}" for i in range(100)]
    assert dropped == 50_000 - 100


def spec(**logs: object) -> JobSpec:
    base = {
        "job": "j",
        "run_id": "r",
        "run_dir": "/tmp",
        "command": ["x"],
        "workdir": "/tmp",
        "env": {},
        "procs_per_node": 4,
        "max_restarts": 0,
        "heartbeat_interval": 1.0,
        "heartbeat_timeout": 5.0,
        "stop_grace": 1.0,
        "preload": [],
    }
    return JobSpec.model_validate({**base, **logs})


def test_redirects_tee_and_the_filter_decide_the_streams_as_torchrun_does():
    assert [console_streams(spec(), lr) for lr in range(4)] == [3, 3, 3, 3]
    assert [console_streams(spec(redirects=3), lr) for lr in range(4)] == [0, 0, 0, 0]
    both = spec(redirects={0: 1, 1: 2, 2: 3}, tee={2: 2})
    assert [console_streams(both, lr) for lr in range(4)] == [2, 1, 2, 3]
    filtered = spec(local_ranks_filter=[1, 3], redirects={3: 1})
    assert [console_streams(filtered, lr) for lr in range(4)] == [0, 3, 0, 2]
    assert console_streams(spec(console=False), 0) == 0
    assert prefix(12) == "[rank12]: "


def test_the_logs_section_takes_torchruns_spellings_and_names_a_bad_value():
    logs = LogsSection.model_validate(
        {"redirects": "0:1, 1:2", "tee": 3, "local_ranks_filter": "0,1"}
    )
    assert (logs.redirects, logs.tee, logs.local_ranks_filter) == ({0: 1, 1: 2}, 3, [0, 1])
    assert LogsSection.model_validate({"redirects": {0: 3}, "local_ranks_filter": 2}).redirects == {
        0: 3
    }
    for bad, where, says in [
        ({"redirects": "5"}, "redirects", "0 (neither)"),
        ({"tee": "0:1,x"}, "tee", "'x' in '0:1,x'"),
        ({"redirects": {0: 7}}, "redirects", "0 (neither)"),
        ({"local_ranks_filter": "0,-1"}, "local_ranks_filter", "'0,-1'"),
        ({"console": "loud"}, "console", "boolean"),
    ]:
        with pytest.raises(ValidationError) as caught:
            LogsSection.model_validate(bad)
        error = caught.value.errors()[0]
        assert error["loc"][0] == where and says in str(caught.value), caught.value


def test_a_job_file_and_set_give_the_logs_fields_and_a_bad_one_is_named_with_its_source(
    tmp_path,
):
    path = tmp_path / "job.yaml"
    path.write_text(
        "job:\n  command: x\n  logs:\n    redirects: 1:3\n    tee: 0:1,1:2\n"
        "    local_ranks_filter: 0,1\n"
    )
    logs = load_raw(read(path, ["job.logs.console=false"]))[0].config.job.logs
    assert (logs.redirects, logs.tee, logs.local_ranks_filter) == ({1: 3}, {0: 1, 1: 2}, [0, 1])
    assert logs.console is False
    with pytest.raises(ConfigError) as caught:
        load_raw(read(path, ["job.logs.redirects=9"]))
    assert "job.logs.redirects (--set job.logs.redirects=9): 9: streams are 0" in str(caught.value)


def test_two_pipes_share_one_capped_log_and_only_the_shown_one_reaches_the_console(tmp_path):
    buffer = ConsoleBuffer()
    pump = LogPump(LogLimits(max_bytes=4096, keep=1), buffer)
    path = tmp_path / "rank-5.log"
    try:
        out = pump.pipe(path, Source(5, "stdout"), header=b"==== mark ====\n")
        err = pump.pipe(path, None)
        os.write(out, b"to the console\n")
        os.write(err, b"only in the log\n")
        os.close(out)
        os.close(err)
        deadline = time.monotonic() + 10
        while "only in the log" not in path.read_text() and time.monotonic() < deadline:
            time.sleep(0.01)
        pump.drain(path)
        text = path.read_text()
        assert text.startswith("==== mark ====\n")
        assert "to the console\n" in text and "only in the log\n" in text
        assert texts(buffer) == ([(5, "stdout", "to the console")], 0)
        # Both pipes count against the one cap: the log is rotated, never past it.
        out = pump.pipe(path, Source(5, "stdout"))
        err = pump.pipe(path, None)
        for _ in range(100):
            os.write(out, b"o" * 99 + b"\n")
            os.write(err, b"e" * 99 + b"\n")
        os.close(out)
        os.close(err)
        deadline = time.monotonic() + 10
        while not Path(f"{path}.1").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        pump.drain(path)
    finally:
        pump.close()
    assert path.stat().st_size <= 4096 and Path(f"{path}.1").stat().st_size <= 4096
    assert not Path(f"{path}.2").exists()


def test_two_streams_in_one_log_are_never_torn_into_each_others_lines(tmp_path):
    """An unbuffered print writes a line's text and its newline apart: the other stream's line
    must not land between them."""
    pump = LogPump(LogLimits())
    path = tmp_path / "rank-0.log"
    try:
        out = pump.pipe(path)
        err = pump.pipe(path)
        for i in range(50):  # each write apart, as the pump reads them
            os.write(out, f"out {i}".encode())
            time.sleep(0.002)
            os.write(err, f"err {i}\n".encode())
            time.sleep(0.002)
            os.write(out, b"\n")
        os.write(out, b"no newline at the end")
        os.close(out)
        os.close(err)
        deadline = time.monotonic() + 10
        while "no newline" not in path.read_text() and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        pump.close()
    lines = path.read_text().split("\n")
    assert lines[-1] == "no newline at the end"
    assert sorted(lines[:-1]) == sorted(
        [f"out {i}" for i in range(50)] + [f"err {i}" for i in range(50)]
    )


def test_a_failed_ranks_tail_is_its_last_lines_within_a_bound():
    text = "\n".join(f"line {i}" for i in range(100)) + "\n"
    assert tail_of(text).splitlines() == [f"line {i}" for i in range(85, 100)]
    assert len(tail_of("x" * 100_000).encode()) == 4096
    assert tail_of("") == ""


# -- planaria run ---------------------------------------------------------------------------------

SCRIPT = """\
import os, sys, time
rank, attempt = int(os.environ["RANK"]), os.environ["TORCHELASTIC_RESTART_COUNT"]
print(f"out of rank {rank} attempt {attempt}", flush=True)
print(f"err of rank {rank} attempt {attempt}", file=sys.stderr, flush=True)
for i in range(3):
    sys.stdout.write(f"\\rprogress {i}")
    sys.stdout.flush()
print(flush=True)
if rank == int(os.environ["FAIL_RANK"]) and attempt == os.environ["FAIL_ATTEMPT"]:
    time.sleep(float(os.environ.get("FAIL_AFTER", "0")))
    for i in range(30):
        print(f"noise {i}", flush=True)
    raise ValueError(f"boom in rank {rank}")
time.sleep(float(os.environ.get("LINGER", "0")))
"""


def script_job(tmp_path: Path, nodes: int, procs: int, restarts: int, env: dict[str, str]) -> Path:
    (tmp_path / "t.py").write_text(SCRIPT)
    config = {
        "job": {
            "name": "console",
            "command": [sys.executable, "t.py"],
            "workdir": str(tmp_path),
            "nodes": nodes,
            "procs_per_node": procs,
            "max_restarts": restarts,
            "preload": [],
            "env": env,
        },
        "rendezvous": {"join_grace": "1s", "join_timeout": "60s"},
        "master": {"heartbeat_interval": "1s", "heartbeat_timeout": "15s"},
        "diagnosis": {"checks": []},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_the_console_shows_every_ranks_lines_prefixed_and_the_logs_mark_the_restart(tmp_path, mark):
    env = {"FAIL_RANK": "3", "FAIL_ATTEMPT": "0", "LINGER": "3"}
    result = run(tmp_path, mark, str(script_job(tmp_path, 2, 2, 1, env)))
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    for rank in range(4):  # both nodes' workers, both attempts, both streams
        for attempt in (0, 1):
            for stream in ("out", "err"):
                assert f"[rank{rank}]: {stream} of rank {rank} attempt {attempt}" in lines
        assert f"[rank{rank}]: progress 2" in lines
    assert "[rank3]: ValueError: boom in rank 3" in lines
    # No line torn: the workers' words only ever follow their prefix, at a line's start.
    for line in lines:
        if "of rank" in line or "progress" in line or "noise" in line:
            assert re.match(r"\[rank\d\]: ", line), line
    # Planaria's own events are on the same console, in order with the lines.
    restarted = next(i for i, line in enumerate(lines) if "workers_restarted" in line)
    assert lines.index("[rank3]: out of rank 3 attempt 0") < restarted
    assert restarted < lines.index("[rank3]: out of rank 3 attempt 1")

    (logs,) = tmp_path.glob("planaria-runs/*/logs")
    for rank in range(4):
        text = (logs / f"rank-{rank}.log").read_text()
        marks = [line for line in text.splitlines() if line.startswith("==== planaria:")]
        assert len(marks) == 1, text
        assert re.fullmatch(
            r"==== planaria: restart 1 \(round 2\) at \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ: "
            r"rank 3 \(node node-\d\) exit code 1 ====",
            marks[0],
        ), marks[0]
        first, second = text.split(marks[0])
        assert f"out of rank {rank} attempt 0" in first and "attempt 1" not in first
        assert f"out of rank {rank} attempt 1" in second and "attempt 0" not in second
    assert "ValueError: boom in rank 3" in (logs / "rank-3.log").read_text().split("====")[0]
    # The job got over the failure: its summary names no failed rank.
    (summary_file,) = tmp_path.glob("planaria-runs/*/summary.json")
    assert json.loads(summary_file.read_text())["failed_rank"] is None
    assert not any(line.startswith("last lines of rank") for line in lines)


def test_filter_redirects_tee_log_dir_and_the_failed_ranks_tail_in_the_summary(tmp_path, mark):
    env = {"FAIL_RANK": "2", "FAIL_ATTEMPT": "0", "FAIL_AFTER": "1", "LINGER": "60"}
    result = run(
        tmp_path,
        mark,
        str(script_job(tmp_path, 1, 3, 0, env)),
        "--local-ranks-filter",
        "0,1",
        "--redirects",
        "3",
        "--tee",
        "0:1",
        "--log-dir",
        "rank-logs",
    )
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    shown = [line for line in lines if line.startswith("[rank")]
    # rank 0: both redirected, stdout tee'd back; rank 1: both redirected; rank 2: filtered.
    assert "[rank0]: out of rank 0 attempt 0" in shown
    assert "[rank0]: progress 2" in shown
    assert all(line.startswith("[rank0]: ") for line in shown), shown
    assert not any("err of rank" in line for line in shown), shown

    (run_logs,) = (tmp_path / "rank-logs").iterdir()
    assert not list(tmp_path.glob("planaria-runs/*/logs/rank-*.log"))
    for rank in range(3):  # the log has every stream, whatever the console showed
        text = (run_logs / f"rank-{rank}.log").read_text()
        assert f"out of rank {rank} attempt 0" in text and f"err of rank {rank}" in text

    log = run_logs / "rank-2.log"
    (summary_file,) = tmp_path.glob("planaria-runs/*/summary.json")
    failed = json.loads(summary_file.read_text())["failed_rank"]
    assert failed["rank"] == 2 and failed["log"] == str(log)
    tail = failed["tail"].splitlines()
    assert len(tail) == 15 and tail[-1] == "ValueError: boom in rank 2"
    assert tail[0].startswith("noise ") and "Traceback (most recent call last):" in tail
    # The summary printed names the log and shows the same lines.
    heading = lines.index(f"last lines of rank 2 ({log}):")
    assert [line.strip() for line in lines[heading + 1 : heading + 16]] == [t.strip() for t in tail]
    assert any(line.startswith("│ failed rank") and "rank-2.log" in line for line in lines)
    assert f"logs: {run_logs}" in lines
    (report,) = tmp_path.glob("planaria-runs/*/report.html")
    page = report.read_text()
    assert "last lines of rank 2:" in page and "ValueError: boom in rank 2</pre>" in page
