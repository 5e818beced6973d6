"""Diagnosis pieces on their own: classification, hang timer, step times, stacks, chaos rules."""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from planaria import monitor
from planaria.chaos import ChaosRule
from planaria.config.loader import parse_text
from planaria.config.resolve import load_raw
from planaria.diagnosis.classify import Classifier, exception_line
from planaria.diagnosis.gate import bind_checks, check_node
from planaria.diagnosis.hang import HangWatch
from planaria.diagnosis.messages import CheckSpec, DiagnosisSpec
from planaria.diagnosis.stacks import dump_stack, find_py_spy, truncate
from planaria.diagnosis.stragglers import (
    RankTimes,
    StepTimes,
    StragglerDetector,
    median_without,
)
from planaria.errors import ConfigError
from planaria.fault_pattern.api import FaultClass, FaultPattern
from planaria.master.diagnosis import last_words
from planaria.plugin import hookimpl
from planaria.plugin.manager import PluginManager
from planaria.progress import Progress, ProgressBoard
from planaria.protocol import WorkerFailure

TRACEBACK = """\
Traceback (most recent call last):
  File "/job/train.py", line 10, in <module>
    loss = model(batch)
{last}
"""


def classify(tail: str, exitcode: int | None = 1, sig: int | None = None, **kw):
    return Classifier(**kw).classify(exitcode, sig, tail)


@pytest.mark.parametrize(
    ("line", "kind", "reason"),
    [
        ("RuntimeError: CUDA error: uncorrectable ECC error encountered", "node", "ECC"),
        ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", "transient",
         "out of memory"),
        ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] "
         "Connection closed by peer [127.0.0.1]:4242", "transient", "peer was lost"),
        ("ValueError: shapes (3,4) and (5,6) not aligned", "user", "ValueError: shapes"),
    ],
)  # fmt: skip
def test_a_traceback_is_classified_by_its_hardware_pattern_before_the_exception(line, kind, reason):
    verdict = classify(TRACEBACK.format(last=line))
    assert verdict.kind is FaultClass(kind)
    assert reason in verdict.reason
    if verdict.source == "builtin":
        assert verdict.line == line.strip()


def test_exit_status_alone_when_the_log_says_nothing():
    killed = classify("step 3\n", exitcode=None, sig=signal.SIGKILL)
    assert killed.kind is FaultClass.TRANSIENT and "SIGKILL" in killed.reason
    assert "OOM" in classify("", exitcode=137, sig=None).reason
    segv = classify("", exitcode=None, sig=signal.SIGSEGV)
    assert (segv.kind, segv.reason) == (FaultClass.TRANSIENT, "killed by SIGSEGV")
    plain = classify("bye\n", exitcode=3)
    assert (plain.kind, plain.reason, plain.source) == (FaultClass.TRANSIENT, "exit code 3", "exit")


def test_a_crash_is_told_by_its_last_exception_line_else_by_how_it_ended():
    chained = (
        TRACEBACK.format(last="KeyError: 'lr'")
        + "\nDuring handling of the above exception, another exception occurred:\n\n"
        + TRACEBACK.format(last="ModuleNotFoundError: No module named 'xyz'")
        + "a line the program printed after it\n"
    )
    assert exception_line(chained) == "ModuleNotFoundError: No module named 'xyz'"
    assert exception_line("ValueError: not in a traceback\n") == ""

    def failure(tail: str, exitcode: int | None, sig: int | None, how: str) -> WorkerFailure:
        return WorkerFailure(
            local_rank=0, rank=3, pid=1, exitcode=exitcode, signal=sig, time=0.0,
            log_tail=tail, description=how,
        )  # fmt: skip

    assert last_words(failure(chained, 1, None, "exit code 1")) == exception_line(chained)
    assert last_words(failure("bye\n", 3, None, "exit code 3")) == "exit code 3"
    # A signal says more than a traceback the worker printed (and caught) before it.
    killed = failure(chained, None, signal.SIGKILL, "killed by SIGKILL")
    assert last_words(killed) == "killed by SIGKILL"


def test_config_patterns_come_first_then_plugins_then_the_built_in_ones():
    tail = TRACEBACK.format(last="RuntimeError: CUDA error: an illegal memory access (site X)")
    mine = FaultPattern(pattern=r"\(site X\)", kind="transient", reason="known flaky site")
    vendor = FaultPattern(pattern="illegal memory", kind="user", reason="vendor says user")
    both = classify(tail, config=[mine], plugins=[("vendor", vendor)])
    assert (both.kind, both.reason, both.source) == (
        FaultClass.TRANSIENT,
        "known flaky site",
        "config",
    )
    plugin = classify(tail, plugins=[("vendor", vendor)])
    assert (plugin.kind, plugin.source) == (FaultClass.USER, "plugin vendor")
    assert FaultPattern(pattern="abc", kind="node").label == "abc"


def test_a_bad_pattern_in_the_config_is_an_error_naming_its_path():
    raw = parse_text(
        textwrap.dedent(
            """\
            diagnosis:
              fault_patterns:
                - {pattern: "ok", kind: node, reason: fine}
                - {pattern: "Xid (", kind: node}
                - {pattern: "x", kind: hardware}
            """
        ),
        "job.yaml",
    )
    with pytest.raises(ConfigError) as exc:
        load_raw(raw)
    text = str(exc.value)
    assert "diagnosis.fault_patterns[1].pattern (line 4): invalid regular expression" in text
    assert "diagnosis.fault_patterns[2].kind (line 5)" in text
    assert "fault_patterns[0]" not in text


def test_plugins_register_fault_patterns_and_a_broken_one_is_skipped():
    class Vendor:
        @hookimpl
        def planaria_fault_patterns(self):
            yield FaultPattern(pattern="MYCHIP-E42", kind="node", reason="MyChip HBM error")

    class Broken:
        @hookimpl
        def planaria_fault_patterns(self):
            return ["not a record"]

    manager = PluginManager()
    manager.register(Broken(), "broken")
    manager.register(Vendor(), "vendor")
    patterns = manager.fault_patterns()
    assert [(name, p.reason) for name, p in patterns] == [("vendor", "MyChip HBM error")]
    assert "got str" in manager.plugins["broken"].reason  # listed as failed, like any kind
    verdict = Classifier(plugins=patterns).classify(1, None, "fatal: MYCHIP-E42 on hbm3")
    assert (verdict.kind, verdict.source) == (FaultClass.NODE, "plugin vendor")


# -- hangs ---------------------------------------------------------------------------------


def slots(*steps: int) -> list[Progress]:
    return [Progress(step=s, time=0.0, pid=0) for s in steps]


def test_the_hang_timer_starts_at_the_first_step_and_any_rank_standing_still_is_a_hang():
    watch = HangWatch(hang_timeout=5.0, started=0.0)
    assert watch.observe(slots(-1, -1), now=100.0) == []  # slow start-up is no hang
    assert watch.observe(slots(0, -1), now=101.0) == []
    assert watch.observe(slots(3, 3), now=104.0) == []
    assert watch.observe(slots(4, 3), now=108.0) == []  # rank 1 stands since 104: 4 s
    stalls = watch.observe(slots(5, 3), now=109.5)
    assert [(s.local_rank, s.step) for s in stalls] == [(0, 5), (1, 3)]
    assert stalls[1].stalled_s == pytest.approx(5.5)
    never = HangWatch(hang_timeout=5.0, started=0.0)
    never.observe(slots(0, -1), now=10.0)
    assert [s.step for s in never.observe(slots(0, -1), now=15.0)] == [0, -1]


def test_the_first_step_has_its_own_optional_timeout():
    watch = HangWatch(hang_timeout=5.0, started=0.0, first_step_timeout=60.0)
    assert watch.observe(slots(-1), now=59.0) == []
    (stall,) = watch.observe(slots(-1), now=60.0)
    assert (stall.step, stall.stalled_s) == (-1, 60.0)


# -- stragglers ----------------------------------------------------------------------------


def test_step_times_are_medians_over_a_full_window_of_board_reads():
    times = StepTimes(window=3)
    for step, t, busy in [(0, 10.0, None), (1, 10.1, 0.05), (2, 10.2, 0.07), (4, 10.6, 0.06)]:
        times.observe([Progress(step=step, time=t, pid=1, busy=busy)])
        times.observe([Progress(step=step, time=t, pid=1, busy=busy)])  # no change, no sample
    wall, busy = times.medians(0)
    assert wall == pytest.approx(0.1) and busy == pytest.approx(0.06)
    assert StepTimes(window=3).medians(0) == (None, None)


def test_a_rank_slower_than_factor_times_the_others_is_flagged_once():
    detector = StragglerDetector(factor=2.0)
    times = {r: RankTimes(f"n{r // 2}", r % 2, 0.1, 0.01) for r in range(4)}
    assert detector.check(times) == []
    times[3] = RankTimes("n1", 1, 0.1, 0.035)  # busy 3.5x; lockstep wall times stay equal
    (slow,) = detector.check(times)
    assert (slow.rank, slow.metric, round(slow.ratio, 1)) == (3, "busy", 3.5)
    assert "rank 3 (node n1) is a straggler: busy time 35.0 ms" in slow.describe()
    assert detector.check(times) == []  # once
    assert detector.check({0: RankTimes("a", 0, 0.1, None)}) == []
    two = StragglerDetector(factor=2.0).check(
        {0: RankTimes("a", 0, 0.1, 0.01), 1: RankTimes("b", 0, 0.5, 0.01)}
    )
    assert [(s.rank, s.metric) for s in two] == [(1, "wall")]


def test_monitor_reports_busy_time_and_slow_worker_burns_in_proportion(tmp_path, monkeypatch):
    board = ProgressBoard(tmp_path / "board", 1)
    try:
        rule = {"kind": "slow_worker", "rank": 0, "factor": 3, "at_step": 2}
        monkeypatch.setenv("PLANARIA_PROGRESS_FILE", str(board.path))
        monkeypatch.setenv(
            "PLANARIA_CHAOS", f"[{ChaosRule.model_validate(rule).model_dump_json()}]"
        )
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setattr(monitor, "_pid", None)
        busy = []
        for step in range(5):
            end = time.process_time() + 0.02
            while time.process_time() < end:
                pass
            monitor.step(step)
            busy.append(board.read(0).busy)
        assert busy[0] is None  # nothing to measure from
        assert all(0.015 < b < 0.04 for b in busy[1:3])  # steps 1, 2: the work alone
        assert all(0.05 < b < 0.09 for b in busy[3:])  # the burn after step 2 counts in step 3
    finally:
        board.close()
        monkeypatch.setattr(monitor, "_pid", None)


# -- chaos rules ---------------------------------------------------------------------------


def test_new_chaos_rules_parse_and_bad_ones_say_why():
    assert ChaosRule.model_validate("stop_worker rank=1 at_step=5").in_worker
    slow = ChaosRule.model_validate("slow_worker rank=3 factor=4")
    assert (slow.at_step, slow.factor, slow.in_worker) == (0, 4.0, True)
    for text, why in [
        ("hang_worker rank=1 after=5s", "hang_worker fires inside the worker: give at_step"),
        ("slow_worker rank=1", "slow_worker takes factor"),
        ("kill_worker rank=1 at_step=3 factor=2", "only slow_worker does"),
        ("slow_worker rank=1 factor=0.5", "greater than 1"),
    ]:
        with pytest.raises(ValidationError, match=why):
            ChaosRule.model_validate(text)


def _worker(tmp_path: Path, rule: str) -> subprocess.Popen[bytes]:
    rule_json = ChaosRule.model_validate(rule).model_dump_json()
    script = tmp_path / "work.py"
    script.write_text(
        "from planaria import monitor\n"
        "def train():\n"
        "    for step in range(100):\n"
        "        monitor.step(step)\n"
        "train()\n"
    )
    env = {**os.environ, "PLANARIA_CHAOS": f"[{rule_json}]", "RANK": "1"}
    return subprocess.Popen([sys.executable, str(script)], env=env, stderr=subprocess.PIPE)


def _wait_state(pid: int, letter: str) -> None:
    from planaria.diagnosis.stacks import process_state

    deadline = time.monotonic() + 30
    while not process_state(pid).startswith(letter):
        assert time.monotonic() < deadline, process_state(pid)
        time.sleep(0.05)


@pytest.mark.skipif(find_py_spy() is None, reason="py-spy is not installed")
def test_stacks_of_a_stopped_and_of_a_hung_worker_show_the_training_frames(tmp_path):
    stopped = _worker(tmp_path, "stop_worker rank=1 at_step=3")
    hung = _worker(tmp_path, "hang_worker rank=1 at_step=4")
    try:
        _wait_state(stopped.pid, "T")
        time.sleep(0.5)  # the hung one is asleep in its loop by now
        first = asyncio.run(dump_stack(stopped.pid, find_py_spy()))
        second = asyncio.run(dump_stack(hung.pid, find_py_spy()))
        assert "train (work.py:4)" in first and "check (" in first, first
        assert "train (work.py:4)" in second and "check (" in second, second
    finally:
        for proc in (stopped, hung):
            proc.kill()
            proc.wait()
    assert b"planaria chaos: stop_worker rank=1 at_step=3" in stopped.stderr.read()
    stopped.stderr.close()
    hung.stderr.close()


def test_without_py_spy_the_dump_says_so_and_long_dumps_are_cut():
    note = asyncio.run(dump_stack(os.getpid(), None))
    assert note.startswith("no stack: py-spy is not installed")
    gone = asyncio.run(dump_stack(2**22 + 12345, "/bin/false"))
    assert gone.startswith("no stack: py-spy failed")
    cut = truncate("\n".join(f"line {i}" for i in range(200)), max_lines=10)
    assert cut.splitlines()[-1] == "... 190 more line(s) cut" and len(cut.splitlines()) == 11


# -- health checks in the loop -------------------------------------------------------------


def test_a_check_this_node_cannot_run_is_a_failure_not_a_crash(tmp_path):
    manager = PluginManager.from_entry_points()
    specs = [
        CheckSpec(name="host", backend="host", options={}, timeout=30),
        CheckSpec(name="chip", backend="no_such_chip", options={}, timeout=30),
        CheckSpec(name="strict", backend="host", options={"min_shm": "lots"}, timeout=30),
    ]
    checks, failures = bind_checks(specs, manager)
    assert [c.name for c in checks] == ["host"]
    assert [(f.check, f.status) for f in failures] == [("chip", "error"), ("strict", "error")]
    assert "no_such_chip" in failures[0].detail and "min_shm" in failures[1].detail
    huge = CheckSpec(
        name="disk", backend="host", options={"min_free_disk": "1000000TiB"}, timeout=30
    )
    (bad,) = check_node(DiagnosisSpec(checks=[huge]), "n0", tmp_path)
    assert (bad.check, bad.status) == ("disk", "failed") and "free" in bad.detail
    assert check_node(DiagnosisSpec(), "n0", tmp_path) == []


@given(
    st.lists(st.floats(min_value=0, max_value=1e6, allow_nan=False), min_size=2, max_size=60),
    st.data(),
)
def test_median_without_one_is_the_median_of_the_others(values, data):
    ordered = sorted(values)
    place = data.draw(st.integers(min_value=0, max_value=len(ordered) - 1))
    others = ordered[:place] + ordered[place + 1 :]
    assert median_without(ordered, place) == pytest.approx(statistics.median(others))


def test_the_straggler_check_is_the_same_for_many_ranks():
    """One slow rank among 2,001 is found, and only it (the sorted check against the plain
    definition, a median of the others per rank)."""
    times = {r: RankTimes(f"n{r}", 0, None, 0.1 + (r % 7) * 0.001) for r in range(2001)}
    times[1234] = RankTimes("n1234", 0, None, 0.5)
    (slow,) = StragglerDetector(factor=2.0).check(times)
    assert (slow.rank, slow.metric) == (1234, "busy")
    plain = statistics.median(t.busy_s for r, t in times.items() if r != 1234)
    assert slow.others_s == pytest.approx(plain)


@given(
    st.lists(st.floats(min_value=0, max_value=10, allow_nan=False), min_size=2, max_size=40),
    st.floats(min_value=1.01, max_value=4),
)
def test_the_straggler_check_flags_exactly_the_ranks_the_definition_does(busy, factor):
    """Looked at from the slowest down and stopped at the first rank that is not slow, the
    check flags every rank, and only those, that work ``factor`` times longer than the median
    of the others (ties and zero medians included)."""
    times = {r: RankTimes(f"n{r}", 0, None, b) for r, b in enumerate(busy)}
    flagged = {s.rank for s in StragglerDetector(factor).check(times)}
    plain = set()
    for r, b in enumerate(busy):
        others = statistics.median(busy[:r] + busy[r + 1 :])
        if others > 0 and b > factor * others:
            plain.add(r)
    assert flagged == plain
