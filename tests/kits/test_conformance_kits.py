"""The conformance kits fail what breaks the contract, and pass what keeps it.

Each file under ``tests/fixtures/kits`` subclasses one kit for a plugin that keeps the contract
(where the fixture has one) and for copies that each break it in one way. pytest runs the file
in a child process, as a plugin author would, and every class must fail exactly the kit's tests
that its fault breaks.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from support.pytest_runs import PytestRun, run_pytest

KITS = Path(__file__).resolve().parents[1] / "fixtures" / "kits"
PLUGINS = Path(__file__).resolve().parents[1] / "fixtures" / "plugins"
RUN_ENV = "PLANARIA_KIT_TEST_RUN"


def _tagged(tag: str) -> list[int]:
    """Processes whose environment holds ``RUN_ENV=tag``: what a run left behind."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError), open(f"/proc/{entry}/environ", "rb") as f:
            if f"{RUN_ENV}={tag}".encode() in f.read().split(b"\0"):
                found.append(int(entry))
    return found


@pytest.fixture
def run_kit(tmp_path: Path) -> Iterator[Callable[..., PytestRun]]:
    tag = uuid.uuid4().hex

    def run(name: str, *plugins: str) -> PytestRun:
        target = tmp_path / name
        shutil.copy(KITS / name, target)
        paths = [str(PLUGINS / p) for p in plugins]
        env = {k: v for k, v in os.environ.items() if k != "PLANARIA_DISABLE_PLUGINS"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [*paths, env.get("PYTHONPATH")]))
        env[RUN_ENV] = tag
        return run_pytest(target, env, tmp_path, "-q", "-p", "no:randomly")

    yield run
    left = _tagged(tag)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"the kit's run left processes behind: {left}"


def failures_by_class(run: PytestRun) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for test, outcome in run.outcomes.items():
        cls, name = test.split("::", 1)
        out.setdefault(cls, set())
        if outcome in ("failed", "error"):
            out[cls].add(name)
    return out


def test_the_health_check_kit(run_kit: Callable[..., PytestRun]) -> None:
    run = run_kit("broken_health.py")
    assert failures_by_class(run) == {
        "TestGood": set(),
        "TestRaisesWhenHealthy": {
            "test_healthy",
            "test_devices_and_metrics",
            "test_a_raising_check_is_an_error_and_hides_no_other",
            "test_a_hanging_check_is_cancelled_within_its_timeout",
        },
        "TestIgnoresCancel": {"test_its_own_hang_ends_when_cancelled"},
        "TestBoolMetrics": {"test_devices_and_metrics"},
        "TestDegradedSaysNotWhy": {"test_degraded_with_reasons"},
        "TestDegradedAsFailed": {"test_degraded_with_reasons"},
        "TestCrashesWithoutDriver": {
            "test_not_applicable_is_said_not_raised",
            "test_devices_and_metrics",
        },
        "TestCrashesWhenUndecided": {"test_undecidable_is_an_error_with_the_check_s_message"},
        "TestNoSummary": {"test_record"},
    }, run.output
    assert not run.named("skipped"), run.messages
    assert "metric ecc_ok is a bool, not a number" in run.output
    assert "run() did not end within 2s of cancel()" in run.output


def test_the_fault_pattern_kit(run_kit: Callable[..., PytestRun]) -> None:
    run = run_kit("broken_patterns.py")
    assert failures_by_class(run) == {
        "TestGood": set(),
        "TestTooBroad": {"test_a_healthy_log_is_no_fault"},
        "TestNoReason": {"test_each_pattern_compiles_and_says_why"},
        "TestMisclassified": {"test_samples_classify_as_documented"},
        "TestShadowed": {"test_every_pattern_is_the_verdict_of_a_sample"},
    }, run.output


def test_the_rank_placement_kit(run_kit: Callable[..., PytestRun]) -> None:
    run = run_kit("broken_placements.py")
    assert failures_by_class(run) == {
        "TestGood": set(),
        "TestTopology": set(),
        "TestEveryOne": {
            "test_every_round_gets_size_members_ranked_0_to_size",
            "test_survivors_keep_their_ranks",
            "test_a_lost_nodes_rank_goes_to_a_newcomer",
        },
        "TestFromOne": {
            "test_every_round_gets_size_members_ranked_0_to_size",
            "test_a_world_of_one_and_a_world_of_everyone",
            "test_survivors_keep_their_ranks",
            "test_a_lost_nodes_rank_goes_to_a_newcomer",
        },
        "TestShuffled": {"test_the_same_round_is_placed_the_same"},
        "TestForgetsSurvivors": {
            "test_survivors_keep_their_ranks",
            "test_a_lost_nodes_rank_goes_to_a_newcomer",
        },
        "TestSortsInPlace": {"test_the_candidates_are_left_as_they_came"},
    }, run.output
    # Only the placement that does not say it keeps ranks skips the survivors' tests.
    assert {t.split("::")[0] for t in run.named("skipped")} == {"TestShuffled"}, run.messages
    assert "survivors moved" in run.output


@pytest.mark.slow
def test_the_scheduler_kit(run_kit: Callable[..., PytestRun]) -> None:
    run = run_kit("broken_schedulers.py")
    assert failures_by_class(run) == {
        "TestSlowPoll": {"test_poll_never_blocks_past_its_timeout"},
        "TestLossAsSuccess": {
            "test_a_node_s_exit_is_reported",
            "test_a_node_killed_from_outside_is_reported_lost",
        },
        "TestStopsOnlyAll": {
            "test_stop_leaves_no_process",
            "test_stop_is_idempotent_and_silences_the_nodes",
            "test_an_unknown_node_id_is_an_error_naming_it",
        },
        "TestEndsTwice": {"test_a_node_ends_once"},
        "TestEndpointsAsAddresses": {"test_node_addresses_before_a_launch_then_a_launch"},
    }, run.output


@pytest.mark.slow
def test_the_node_benchmark_kit(run_kit: Callable[..., PytestRun]) -> None:
    run = run_kit("broken_benchmarks.py", "kitbench")
    assert failures_by_class(run) == {
        "TestZeroTimings": {
            "test_runs_alone_in_a_child_process",
            "test_runs_in_a_group_of_two",
            "test_a_missing_peer_is_a_clear_failure_within_its_timeout",
        },
        "TestDeaf": {
            "test_runs_in_a_group_of_two",
            "test_a_missing_peer_is_a_clear_failure_within_its_timeout",
        },
    }, run.output
    assert "measures are durations in seconds, above zero" in run.output
    assert "without its peer was still running" in run.output
