"""The master's fault policy, one row per branch: (rules, situation, event) -> decision."""

from __future__ import annotations

from dataclasses import replace

import pytest

from planaria.events import StopCause
from planaria.master.policy import (
    CANNOT_START,
    Act,
    Crash,
    Decision,
    FaultType,
    NodeFault,
    ReplacementFailed,
    Rules,
    Situation,
    Source,
    decide,
    remember,
)

RULES = Rules(max_restarts=3, min_nodes=2, max_nodes=4)
TRAINING = Situation(restarts=0, training=True, nodes_left=3)


def fault(type_: FaultType, source: Source = Source.WORKERS, **kw: object) -> NodeFault:
    base = NodeFault(
        type=type_,
        source=source,
        node="node-1",
        host="host-1",
        detail="rank 1 (node node-1) exit code 1",
        reason="KeyError: 'lr'",
        in_world=True,
    )
    return replace(base, **kw)  # type: ignore[arg-type]


def preflight(source: Source = Source.PREFLIGHT) -> NodeFault:
    return fault(FaultType.NODE, source, in_world=False)


BEFORE_TRAINING = Situation(nodes_left=3)
EXCLUDE = "replace the node, exclude host host-1"
MISSING = "ModuleNotFoundError: No module named 'no_such_module_xyz'"
LOOP = "stop: crash loop (diagnosis.crash_loop_rounds: 2)"
RESTART = (Act.RESTART, "restart workers in place", False, False, True, True)
AFTER_CRASH = replace(TRAINING, restarts=1, crashes=(Crash(1, MISSING, round=1),), stepped=True)
"""Round 1 ended with rank 1's crash before any step; round 2 runs."""
SIGKILLED = "killed by SIGKILL"
AFTER_KILL = replace(
    TRAINING, restarts=1, crashes=(Crash(1, SIGKILLED, round=1, signal="SIGKILL"),)
)
"""Round 1 of a job that reports no steps ended with rank 1 SIGKILLed; round 2 runs."""


def crashed(type_: FaultType = FaultType.USER, rank: int = 1, error: str = MISSING,
            round_: int = 2, source: Source = Source.WORKERS) -> NodeFault:  # fmt: skip
    """Rank ``rank`` failed with ``error`` in round ``round_`` before any step."""
    return fault(type_, source, crashes=(Crash(rank, error, round=round_),))


def killed(signal: str = "SIGKILL", round_: int = 2) -> NodeFault:
    """Rank 1 ended by ``signal`` in round ``round_`` with no step of its round."""
    crash = Crash(1, f"killed by {signal}", round=round_, signal=signal)
    return fault(FaultType.TRANSIENT, crashes=(crash,))


# id, rules, situation, event, decision (act, action, remove, exclude_host, restart, record)
ROWS = [
    ("transient restarts in place", RULES, TRAINING, fault(FaultType.TRANSIENT),
     (Act.RESTART, "restart workers in place", False, False, True, True)),
    ("hang restarts in place", RULES, TRAINING, fault(FaultType.HANG, Source.WATCHDOG),
     (Act.RESTART, "restart workers in place", False, False, True, True)),
    ("user error restarts by default", RULES, TRAINING, fault(FaultType.USER),
     (Act.RESTART, "restart workers in place", False, False, True, True)),
    ("user error stops with on_user_error: stop", replace(RULES, on_user_error="stop"),
     TRAINING, fault(FaultType.USER),
     (Act.STOP, "stop (diagnosis.on_user_error: stop)", False, False, False, True)),
    ("workers that cannot start stop the job", RULES, TRAINING,
     fault(FaultType.USER, Source.START),
     (Act.STOP, CANNOT_START, False, False, False, True)),
    ("budget spent stops a transient fault", RULES, replace(TRAINING, restarts=3),
     fault(FaultType.TRANSIENT),
     (Act.STOP, "stop: restart budget spent", False, False, False, True)),
    ("node fault replaces, excludes and restarts", RULES, TRAINING, fault(FaultType.NODE),
     (Act.REPLACE, EXCLUDE, True, True, True, True)),
    ("node fault with max_restarts 0 stops, no replacement",
     replace(RULES, max_restarts=0), TRAINING, fault(FaultType.NODE),
     (Act.STOP, "stop: restart budget spent", True, False, False, True)),
    ("lost node is replaced, its host kept", RULES, TRAINING,
     fault(FaultType.LOST, Source.AGENT),
     (Act.REPLACE, "replace the node", True, False, True, True)),
    ("lost node outside the world spends no restart", RULES,
     replace(TRAINING, restarts=3), fault(FaultType.LOST, Source.AGENT, in_world=False),
     (Act.REPLACE, "replace the node", True, False, False, True)),
    ("node fault while a round forms spends no restart", RULES,
     replace(TRAINING, training=False), fault(FaultType.NODE, Source.HEALTH_CHECK),
     (Act.REPLACE, EXCLUDE, True, True, False, True)),
    ("late node fault still takes the node out", RULES, TRAINING,
     fault(FaultType.NODE, Source.LATE),
     (Act.REPLACE, EXCLUDE, True, True, True, True)),
    ("late transient fault: its round restarted already", RULES, TRAINING,
     fault(FaultType.TRANSIENT, Source.LATE),
     (Act.NONE, "none (its round was restarted already)", False, False, False, False)),
    ("late user error never stops", replace(RULES, on_user_error="stop"), TRAINING,
     fault(FaultType.USER, Source.LATE),
     (Act.NONE, "none (its round was restarted already)", False, False, False, False)),
    ("transient with no round running", RULES, replace(TRAINING, training=False),
     fault(FaultType.TRANSIENT),
     (Act.NONE, "none (its round was restarted already)", False, False, False, False)),
    ("job already stopping", RULES, replace(TRAINING, stopping=True), fault(FaultType.NODE),
     (Act.NONE, "none (the job is stopping)", False, False, False, False)),
    ("node already out of the job", RULES, TRAINING, fault(FaultType.NODE, node_gone=True),
     (Act.NONE, "none (the node is out of the job already)", False, False, False, False)),
    ("straggler only reported by default", RULES, TRAINING,
     fault(FaultType.NODE, Source.STRAGGLER),
     (Act.NONE, "none (diagnosis.replace_stragglers: false)", False, False, False, False)),
    ("straggler replaced with replace_stragglers", replace(RULES, replace_stragglers=True),
     TRAINING, fault(FaultType.NODE, Source.STRAGGLER),
     (Act.REPLACE, EXCLUDE, True, True, True, True)),
    ("pre-flight faulty node replaced", RULES, BEFORE_TRAINING, preflight(),
     (Act.REPLACE, EXCLUDE, True, True, False, True)),
    ("pre-flight check alone replaces none", replace(RULES, preflight_only=True),
     BEFORE_TRAINING, preflight(),
     (Act.NONE, "none (planaria check --preflight reports only)", False, False, False, True)),
    ("pre-flight straggler reported by default", RULES, BEFORE_TRAINING,
     preflight(Source.PREFLIGHT_STRAGGLER),
     (Act.NONE, "none (report only)", False, False, False, False)),
    ("pre-flight straggler never replaced by the check alone",
     replace(RULES, preflight_replace_stragglers=True, preflight_only=True), BEFORE_TRAINING,
     preflight(Source.PREFLIGHT_STRAGGLER),
     (Act.NONE, "none (report only)", False, False, False, False)),
    ("pre-flight straggler replaced", replace(RULES, preflight_replace_stragglers=True),
     BEFORE_TRAINING, preflight(Source.PREFLIGHT_STRAGGLER),
     (Act.REPLACE, EXCLUDE, True, True, False, True)),
    ("pre-flight out of replacements shrinks", RULES,
     replace(BEFORE_TRAINING, preflight_replaced=4), preflight(),
     (Act.SHRINK, "stop the node, no replacement: the pre-flight replaced 4 node(s) already",
      True, False, False, True)),
    ("pre-flight out of replacements, too few nodes left, stops", RULES,
     replace(BEFORE_TRAINING, preflight_replaced=4, nodes_left=1), preflight(),
     (Act.STOP, "stop: the pre-flight replaced 4 node(s) already", True, False, False, True)),
    ("no replacement came, elastic job shrinks", RULES, replace(TRAINING, nodes_left=2),
     ReplacementFailed("node-1", "no free slot"),
     (Act.SHRINK, "go on with 2 node(s)", False, False, False, False)),
    ("no replacement came, too few nodes left, stops", RULES,
     replace(TRAINING, nodes_left=1), ReplacementFailed("node-1", "no free slot"),
     (Act.STOP, "stop: too few nodes", False, False, False, False)),
    ("no replacement came while stopping", RULES, replace(TRAINING, stopping=True),
     ReplacementFailed("node-1", "interrupted"),
     (Act.NONE, "none (the job is stopping)", False, False, False, False)),
    ("a first crash before any step restarts", RULES, TRAINING, crashed(round_=1), RESTART),
    ("the same crash before any step in two rounds in a row stops", RULES, AFTER_CRASH,
     crashed(), (Act.STOP, LOOP, False, False, False, True)),
    ("an exit code after an exception is another failure: restarts", RULES, AFTER_CRASH,
     replace(crashed(FaultType.TRANSIENT), crashes=(Crash(1, "exit code 1", round=2),)),
     RESTART),
    ("the same exit code before any step twice stops",
     RULES, replace(AFTER_CRASH, crashes=(Crash(1, "exit code 1", round=1),)),
     replace(crashed(FaultType.TRANSIENT), crashes=(Crash(1, "exit code 1", round=2),)),
     (Act.STOP, LOOP, False, False, False, True)),
    ("step progress in between: the same failure restarts", RULES, AFTER_CRASH,
     fault(FaultType.USER), RESTART),
    ("a round in between that made progress: the same crash restarts", RULES, AFTER_CRASH,
     crashed(round_=3), RESTART),
    ("a different error restarts", RULES, AFTER_CRASH, crashed(error="KeyError: 'lr'"),
     RESTART),
    ("the same error on another rank restarts", RULES, AFTER_CRASH, crashed(rank=2), RESTART),
    ("crash_loop_rounds 0 never stops", replace(RULES, crash_loop_rounds=0), AFTER_CRASH,
     crashed(), RESTART),
    ("crash_loop_rounds 3 restarts after the second round", replace(RULES, crash_loop_rounds=3),
     AFTER_CRASH, crashed(), RESTART),
    ("crash_loop_rounds 3 stops at the third round", replace(RULES, crash_loop_rounds=3),
     replace(AFTER_CRASH, crashes=(Crash(1, MISSING, round=2, rounds=2),)), crashed(round_=3),
     (Act.STOP, "stop: crash loop (diagnosis.crash_loop_rounds: 3)", False, False, False,
      True)),
    ("a crash loop with the budget spent says it is a crash loop", RULES,
     replace(AFTER_CRASH, restarts=3), crashed(), (Act.STOP, LOOP, False, False, False, True)),
    ("a late crash never stops", RULES, AFTER_CRASH, crashed(source=Source.LATE),
     (Act.NONE, "none (its round was restarted already)", False, False, False, False)),
    ("a node fault before any step twice is still replaced", RULES, AFTER_CRASH,
     crashed(FaultType.NODE), (Act.REPLACE, EXCLUDE, True, True, True, True)),
    ("two outside SIGKILLs of a rank, no step known: restarts", RULES, AFTER_KILL,
     killed(), RESTART),
    ("two outside SIGKILLs of a rank, steps known: restarts", RULES,
     replace(AFTER_KILL, stepped=True), killed(), RESTART),
    ("two SIGTERMs of a rank: restarts", RULES, replace(AFTER_KILL, crashes=(
        Crash(1, "killed by SIGTERM", round=1, signal="SIGTERM"),)),
     killed("SIGTERM"), RESTART),
    ("an outside kill, then the same error: restarts (the kill broke the run)", RULES,
     replace(AFTER_KILL, crashes=(Crash(1, MISSING, round=1, signal="SIGKILL"),)),
     crashed(), RESTART),
    ("an outside kill with crash_loop_rounds 1: restarts", replace(RULES, crash_loop_rounds=1),
     TRAINING, killed(round_=1), RESTART),
    ("the same segfault before any step twice stops (a signal of its own)", RULES,
     replace(AFTER_KILL, crashes=(Crash(1, "killed by SIGSEGV", round=1, signal="SIGSEGV"),)),
     killed("SIGSEGV"), (Act.STOP, LOOP, False, False, False, True)),
    ("the same exception twice, no step known: stops", RULES, replace(AFTER_CRASH,
     stepped=False), crashed(), (Act.STOP, LOOP, False, False, False, True)),
    ("the same exit code twice, no step known: stops", RULES,
     replace(TRAINING, restarts=1, crashes=(Crash(1, "exit code 3", round=1),)),
     replace(crashed(FaultType.TRANSIENT), crashes=(Crash(1, "exit code 3", round=2),)),
     (Act.STOP, LOOP, False, False, False, True)),
]  # fmt: skip


@pytest.mark.parametrize(("rules", "now", "event", "expected"), [r[1:] for r in ROWS],
                         ids=[r[0] for r in ROWS])  # fmt: skip
def test_each_branch(rules, now, event, expected):
    decision = decide(rules, now, event)
    act, action, remove, exclude_host, restart, record = expected
    assert (decision.act, decision.action) == (act, action)
    assert (decision.remove, decision.exclude_host, decision.restart) == (
        remove,
        exclude_host,
        restart,
    )
    assert decision.record is record
    assert bool(decision.reason) is (act is Act.STOP)


def test_stop_reasons_say_what_was_spent_and_what_happened():
    spent = decide(
        replace(RULES, max_restarts=1), replace(TRAINING, restarts=1), fault(FaultType.HANG)
    )
    assert spent.reason == (
        "restart budget spent (1 of 1 restarts used); last fault: rank 1 (node node-1) exit code 1"
    )
    user = decide(replace(RULES, on_user_error="stop"), TRAINING, fault(FaultType.USER))
    assert user.reason == "user error: rank 1 (node node-1) exit code 1: KeyError: 'lr'"
    start = decide(RULES, TRAINING, fault(FaultType.USER, Source.START))
    assert start.reason == "user error: rank 1 (node node-1) exit code 1"
    few = decide(RULES, replace(TRAINING, nodes_left=1), ReplacementFailed("node-1", "no slot"))
    assert few.reason == (
        "node node-1 could not be replaced (no slot), and 1 node(s) are left: the job needs "
        "at least 2 (job.nodes)"
    )


def test_a_crash_loop_says_which_rank_what_error_and_how_to_change_it():
    loop = decide(RULES, AFTER_CRASH, crashed())
    assert loop.cause is StopCause.CRASH_LOOP
    assert loop.reason == (
        f"crash loop: rank 1 failed with {MISSING!r} twice, in 2 consecutive rounds, each time "
        "before any step; a restart would fail the same way. Fix the error, or set "
        "diagnosis.crash_loop_rounds (now 2; 0 turns this off) to restart anyway"
    )
    once = decide(
        replace(RULES, crash_loop_rounds=1), replace(TRAINING, stepped=True), crashed(round_=1)
    )
    assert once.act is Act.STOP
    assert f"rank 1 failed with {MISSING!r} before any step; a restart" in once.reason


def test_a_crash_loop_of_a_job_that_reports_no_steps_does_not_claim_before_any_step():
    loop = decide(RULES, replace(AFTER_CRASH, stepped=False), crashed())
    assert loop.reason.startswith(
        f"crash loop: rank 1 failed with {MISSING!r} twice, in 2 consecutive rounds, each time "
        "before any step was reported (it reports none); a restart would fail the same way."
    )


def test_remember_breaks_a_ranks_run_at_an_outside_kill():
    kill = Crash(0, SIGKILLED, 2, signal="SIGKILL")
    first = remember((), [Crash(0, SIGKILLED, 1, signal="SIGKILL")])
    assert remember(first, [kill]) == (kill,)  # rounds stays 1: a kill repeats nothing
    assert kill.killed and not Crash(0, "killed by SIGSEGV", 2, signal="SIGSEGV").killed
    segv = remember((), [Crash(0, "killed by SIGSEGV", 1, signal="SIGSEGV")])
    assert remember(segv, [Crash(0, "killed by SIGSEGV", 2, signal="SIGSEGV")])[0].rounds == 2


def test_remember_counts_a_ranks_crash_in_consecutive_rounds_only():
    one = remember((), [Crash(0, "A", 1), Crash(1, "B", 1)])
    assert one == (Crash(0, "A", 1), Crash(1, "B", 1))
    two = remember(one, [Crash(0, "A", 2), Crash(1, "C", 2)])
    assert two == (Crash(0, "A", 2, rounds=2), Crash(1, "C", 2))
    assert remember(two, [Crash(0, "A", 2)]) == two  # a round's crash counts once
    # A round with no crash of rank 0 (it stepped, or hung) breaks its run.
    assert remember(two, [Crash(0, "A", 4)]) == (Crash(0, "A", 4),)  # round 2's are forgotten
    late = remember(two, [Crash(1, "C", 1)])  # an older round's report, come late
    assert late == two


def test_the_budget_is_spent_by_the_restart_that_would_exceed_it():
    rules = replace(RULES, max_restarts=2)
    acts = [decide(rules, replace(TRAINING, restarts=n), fault(FaultType.TRANSIENT)).act
            for n in range(4)]  # fmt: skip
    assert acts == [Act.RESTART, Act.RESTART, Act.STOP, Act.STOP]


def test_a_decision_is_a_value():
    decision = decide(RULES, TRAINING, fault(FaultType.NODE))
    assert decision == decide(RULES, TRAINING, fault(FaultType.NODE))
    assert isinstance(decision, Decision)
    with pytest.raises(AttributeError):
        decision.act = Act.STOP  # type: ignore[misc]
