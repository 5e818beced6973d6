"""Run-time diagnosis end to end: ``planaria run`` with real agents, workers and faults.

Hangs (a SIGSTOPped worker, a worker asleep at a step, its peers blocked in the allreduce),
stragglers, classified worker faults and nodes failing their health checks.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

from planaria.testing.jobs import EXAMPLE, events, job, run, start, wait_for, weights

torch = pytest.importorskip("torch")


def _train(*extra: str, steps: int = 24) -> str:
    command = [sys.executable, str(EXAMPLE), "--steps", str(steps), "--ckpt-every", "4", *extra]
    return f"job.command={json.dumps(command)}"


def test_hangs_are_dumped_and_restarted_and_the_weights_are_bitwise_a_clean_runs(tmp_path, mark):
    clean_dir, faulty_dir = tmp_path / "clean", tmp_path / "faulty"
    clean_dir.mkdir()
    faulty_dir.mkdir()
    out = ("--out", "final.pt")
    clean = run(clean_dir, mark, str(job(clean_dir)), "--set", _train(*out))
    assert clean.returncode == 0, clean.stdout + clean.stderr

    chaos = [
        {"kind": "stop_worker", "rank": 1, "at_step": 5},
        {"kind": "hang_worker", "rank": 2, "at_step": 10, "attempt": 1},
        {"kind": "kill_node", "node_rank": 1, "at_step": 15, "attempt": 2},
    ]
    config = job(faulty_dir, chaos=chaos, diagnosis={"checks": [], "hang_timeout": "4s"})
    faulty = run(faulty_dir, mark, str(config), "--set", _train(*out))
    assert faulty.returncode == 0, faulty.stdout + faulty.stderr

    timeline = events(faulty_dir)
    every = [e for e in timeline if e["kind"] == "hang_detected"]
    hangs = [e for e in every if not e["data"]["secondary"]]
    assert len(hangs) == 2, [e["message"] for e in timeline]
    for hang, (rank, state) in zip(hangs, [(1, "T"), (2, "S")], strict=True):
        assert hang["data"]["timeout"] == 4 and not hang["data"]["first_step"]
        for info in hang["data"]["ranks"]:  # the culprit's or a peer's, blocked in allreduce
            assert "train (train_gpt.py:" in info["stack"], info["stack"]
            assert info["stack"].startswith("Thread ")
        assert max(info["stalled_s"] for info in hang["data"]["ranks"]) >= 4
        # The first report restarts the round; the culprit's node, if it was not first, may
        # be stopped before it reports. Where its stack was taken, it shows where it stands.
        round_ = hang["data"]["round"]
        # A later (secondary) report races the restart the first one ordered: the culprit
        # may have died between its stack and its state (a zombie not yet reaped).
        seen = [
            (r, e["data"]["secondary"])
            for e in every
            if e["data"]["round"] == round_
            for r in e["data"]["ranks"]
        ]
        for info, secondary in ((r, s) for r, s in seen if r["rank"] == rank):
            states = (state, "Z") if secondary else (state,)
            assert info["state"].startswith(states), info
            if secondary and info["stack"].startswith("no stack: py-spy failed"):
                continue  # it died between its state and its stack (ESRCH or ENOENT)
            assert "WorkerChaos.check (" in info["stack"], info["stack"]
    faults = [
        f for f in timeline if f["kind"] == "fault_detected" and f["data"]["fault"] != "chaos"
    ]
    assert any(f["data"]["fault"] == "node_lost" for f in faults)
    assert any(e["kind"] == "node_replaced" for e in timeline)
    recovered = [e for e in timeline if e["kind"] == "recovered"]
    assert [e["data"]["fault"] for e in recovered][:2] == ["hang", "hang"]
    summary = " ".join(faulty.stdout.split())
    assert "hang │ transient: no step progress for 4s" in summary

    (clean_out,) = clean_dir.glob("**/final.pt")
    (faulty_out,) = faulty_dir.glob("**/final.pt")
    a, b = weights(clean_out), weights(faulty_out)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


# A tiny job without torch: rank 1 of the first attempt fails as $FAIL_WITH says, if set.
SCRIPT = """\
import os, sys, time
from planaria import monitor

fail = os.environ.get("FAIL_WITH")
if fail and os.environ["RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    print("Traceback (most recent call last):", file=sys.stderr)
    print('  File "train.py", line 9, in <module>', file=sys.stderr)
    print(fail, file=sys.stderr, flush=True)
    sys.exit(1)
for step in range(30):
    time.sleep(0.1)
    monitor.step(step)
"""


def _tiny(tmp_path: Path, fail_with: str, **sections: object) -> Path:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    base = {
        "job": {
            "command": [sys.executable, str(script)],
            "procs_per_node": 1,
            "preload": [],
            "env": {"FAIL_WITH": fail_with},
        },
        "scheduler": {"backend": "local", "options": {"hosts": 3}},
    }
    for name, value in sections.items():
        base[name] = {**base.get(name, {}), **value}  # type: ignore[dict-item]
    return job(tmp_path, **base)


CUDA_IMA = "RuntimeError: CUDA error: an illegal memory access was encountered"


def test_a_node_fault_replaces_the_node_and_excludes_its_host(tmp_path, mark):
    result = run(tmp_path, mark, str(_tiny(tmp_path, CUDA_IMA)))
    assert result.returncode == 0, result.stdout + result.stderr
    timeline = events(tmp_path)
    (fault,) = [e for e in timeline if e["kind"] == "fault_detected" and e["rank"] == 1]
    assert fault["data"]["fault_class"] == "node"
    assert fault["data"]["reason"] == "CUDA illegal memory access (often a failing GPU)"
    assert fault["data"]["matched"] == CUDA_IMA
    (excluded,) = [e for e in timeline if e["kind"] == "node_excluded"]
    host = excluded["data"]["host"]
    assert excluded["node"] == fault["node"] and host in ("local-0", "local-1")
    (replaced,) = [e for e in timeline if e["kind"] == "node_replaced"]
    assert replaced["data"]["replacement_host"] == "local-2"  # never the excluded one
    assert replaced["data"]["excluded_host"] == host
    summary = " ".join(result.stdout.split())
    assert "node: CUDA illegal memory access (often a failing GPU)" in summary
    assert f"replace the node, exclude host {host}" in summary


@pytest.mark.parametrize(("nodes", "code"), [("1:2", 0), (2, 1)])
def test_a_replacement_that_fails_is_no_replacement_and_the_job_shrinks_or_stops(
    tmp_path, mark, nodes, code
):
    # One host for every node: once a node fault excludes it, no node can be placed.
    patterns = [{"pattern": "HBM exploded", "kind": "node", "reason": "bad HBM"}]
    config = _tiny(
        tmp_path,
        "HBM exploded",
        job={"nodes": nodes},
        scheduler={"backend": "local", "options": {"hosts": 1}},
        diagnosis={"fault_patterns": patterns},
    )
    result = run(tmp_path, mark, str(config))
    assert result.returncode == code, result.stdout + result.stderr
    timeline = events(tmp_path)
    kinds = [e["kind"] for e in timeline]
    (fault,) = [e for e in timeline if e["kind"] == "fault_detected" and e["rank"] == 1]
    assert fault["data"]["fault_class"] == "node"
    (failed,) = [e for e in timeline if e["kind"] == "node_replacement_failed"]
    assert failed["node"] == fault["node"] and failed["data"]["host"] == "local-0"
    assert "excluded" in failed["data"]["error"] and failed["data"]["nodes_left"] == 1
    assert "node_replaced" not in kinds and "node_excluded" not in kinds
    if code == 0:  # elastic: the other node trains on alone
        assert failed["data"]["action"] == "go on with 1 node(s)"
        worlds = [e["data"]["ranks"] for e in timeline if e["kind"] == "rendezvous_completed"]
        assert len(worlds[-1]) == 1 and kinds[-1] == "job_finished"
    else:  # at least two nodes needed, one left: stop now, not at the rendezvous timeout
        assert failed["data"]["action"] == "stop: too few nodes"
        (stopped,) = [e for e in timeline if e["kind"] == "job_stopped"]
        assert stopped["data"]["cause"] == "too_few_nodes"
        assert "the job needs at least 2 (job.nodes)" in " ".join(result.stdout.split())


XID_13 = (
    "NVRM: Xid (PCI:0000:3b:00): 13, pid=48211, name=python, Graphics SM Warp Exception on "
    "(GPC 1, TPC 3, SM 0): Out Of Range Address"
)
XID_79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid=48211, name=python, GPU has fallen off the bus."


@pytest.mark.parametrize(("line", "fault_class"), [(XID_13, "user"), (XID_79, "node")])
def test_only_a_hardware_xid_excludes_the_host(tmp_path, mark, line, fault_class):
    pytest.importorskip("planaria_nvidia")  # the Xid patterns come with planaria-nvidia
    result = run(tmp_path, mark, str(_tiny(tmp_path, line)))
    assert result.returncode == 0, result.stdout + result.stderr
    timeline = events(tmp_path)
    (fault,) = [e for e in timeline if e["kind"] == "fault_detected" and e["rank"] == 1]
    assert (fault["data"]["fault_class"], fault["data"]["classified_by"]) == (
        fault_class,
        "plugin nvidia",
    )
    assert fault["data"]["matched"] == line
    excluded = [e for e in timeline if e["kind"] == "node_excluded"]
    restarted = [e for e in timeline if e["kind"] == "workers_restarted"]
    if fault_class == "node":
        assert [e["node"] for e in excluded] == [fault["node"]]
        assert any(e["kind"] == "node_replaced" for e in timeline)
    else:  # the program's own fault on a healthy GPU: restarted in place, no host excluded
        assert excluded == [] and restarted
        assert not any(e["kind"] == "node_replaced" for e in timeline)


def test_config_patterns_reclassify_and_a_user_error_can_stop_the_job(tmp_path, mark):
    transient = tmp_path / "transient"
    transient.mkdir()
    patterns = [{"pattern": "illegal memory", "kind": "transient", "reason": "our known bug"}]
    config = _tiny(transient, CUDA_IMA, diagnosis={"fault_patterns": patterns})
    result = run(transient, mark, str(config))
    assert result.returncode == 0, result.stdout + result.stderr
    timeline = events(transient)
    (fault,) = [e for e in timeline if e["kind"] == "fault_detected" and e["rank"] == 1]
    assert (fault["data"]["fault_class"], fault["data"]["classified_by"]) == ("transient", "config")
    assert not any(e["kind"] in ("node_excluded", "node_replaced") for e in timeline)

    stop = tmp_path / "stop"
    stop.mkdir()
    config = _tiny(stop, "KeyError: 'lr'", diagnosis={"on_user_error": "stop"})
    result = run(stop, mark, str(config))
    assert result.returncode == 1
    text = " ".join(result.stdout.split())
    assert "exit code 1: Python exception: KeyError: 'lr'" in text
    assert "user error: rank 1 (node node-" in text
    assert not any(e["kind"] == "workers_restarted" for e in events(stop))


def test_a_node_failing_its_health_check_is_replaced_before_it_joins(tmp_path, mark):
    check = tmp_path / "check.sh"
    check.write_text(
        "#!/bin/bash\n"
        'if [ "$PLANARIA_NODE" = local-1 ]; then\n'
        '  echo \'{"device": "chip0", "status": "failed", "detail": "12 uncorrectable ECC"}\'\n'
        "  exit 1\n"
        "fi\n"
        'echo \'{"device": "chip0", "status": "ok"}\'\n'
    )
    check.chmod(0o755)
    pytest.importorskip("planaria_custom_script")
    checks = [{"backend": "custom_script", "name": "chip", "options": {"path": str(check)}}]
    config = _tiny(tmp_path, "", diagnosis={"checks": checks})
    result = run(tmp_path, mark, str(config))
    assert result.returncode == 0, result.stdout + result.stderr
    timeline = events(tmp_path)
    (unhealthy,) = [e for e in timeline if e["kind"] == "health_checked"]
    assert unhealthy["data"]["host"] == "local-1" and not unhealthy["data"]["healthy"]
    (failure,) = unhealthy["data"]["failures"]
    assert failure["check"] == "chip" and "chip0: failed 12 uncorrectable ECC" in failure["detail"]
    (excluded,) = [e for e in timeline if e["kind"] == "node_excluded"]
    assert excluded["data"]["host"] == "local-1"
    # The round formed without it: its replacement (local-2) trained, and training finished.
    (rounds,) = [e for e in timeline if e["kind"] == "rendezvous_completed"][:1]
    assert unhealthy["node"] not in rounds["data"]["ranks"]
    assert any(e["kind"] == "job_finished" for e in timeline)


def test_a_straggler_is_reported_once_and_its_node_replaced(tmp_path, mark):
    config = job(
        tmp_path,
        scheduler={"backend": "local", "options": {"hosts": 3}},
        diagnosis={
            "checks": [],
            "straggler_window": 5,
            "straggler_factor": 2.0,
            "replace_stragglers": True,
        },
        chaos=[{"kind": "slow_worker", "rank": 3, "factor": 4}],
    )
    result = run(tmp_path, mark, str(config), "--set", _train(steps=40))
    assert result.returncode == 0, result.stdout + result.stderr
    timeline = events(tmp_path)
    stragglers = [e for e in timeline if e["kind"] == "straggler_detected"]
    slow = stragglers[0]
    assert slow["rank"] == 3 and slow["data"]["metric"] == "busy"
    # Reported once: a straggler is not reported again. (On a busy machine a replacement
    # node, all of its processes new, can be slow in wall time too, and is a straggler of its
    # own.)
    reported = [(e["node"], e["rank"]) for e in stragglers]
    assert len(set(reported)) == len(reported), reported
    excluded = next(e for e in timeline if e["kind"] == "node_excluded")
    assert excluded["node"] == slow["node"]
    host = excluded["data"]["host"]
    assert slow["data"]["ratio"] > 2.0
    assert slow["data"]["action"] == f"replace the node, exclude host {host}"
    assert any(e["kind"] == "recovered" and e["data"]["fault"] == "straggler" for e in timeline)
    summary = " ".join(result.stdout.split())
    assert "stragglers" in summary and "busy" in summary


MISSING = "ModuleNotFoundError: No module named 'no_such_module_xyz'"


def _crashing(tmp_path: Path, code: str, **diagnosis: object) -> Path:
    return job(
        tmp_path,
        job={
            "command": [sys.executable, "-c", code],
            "nodes": 1,
            "procs_per_node": 1,
            "preload": [],
            "max_restarts": 5,
        },
        diagnosis={"checks": [], **diagnosis},
    )


def test_a_crash_before_any_step_stops_the_job_in_its_second_round(tmp_path, mark):
    result = run(tmp_path, mark, str(_crashing(tmp_path, "import no_such_module_xyz")))
    assert result.returncode == 1, result.stdout + result.stderr
    text = " ".join(result.stdout.split())
    assert (
        f"crash loop: rank 0 failed with {MISSING!r} twice, in 2 consecutive rounds, each time "
        "before any step" in text
    ), text
    assert "diagnosis.crash_loop_rounds" in text
    timeline = events(tmp_path)
    restarted = [e for e in timeline if e["kind"] == "workers_restarted"]
    assert len(restarted) == 1, [e["message"] for e in timeline]  # 2 rounds, 1 of 5 restarts
    rounds = [e["data"]["round"] for e in timeline if e["kind"] == "fault_detected"]
    assert rounds == [1, 2]
    (stopped,) = [e for e in timeline if e["kind"] == "job_stopped"]
    assert stopped["data"]["cause"] == "crash_loop"


def test_a_crash_after_step_progress_is_restarted_as_before(tmp_path, mark):
    stepping = "from planaria import monitor; monitor.step(0); import no_such_module_xyz"
    result = run(tmp_path, mark, str(_crashing(tmp_path, stepping)))
    assert result.returncode == 1, result.stdout + result.stderr
    text = " ".join(result.stdout.split())
    assert "restart budget spent (5 of 5 restarts used)" in text, text
    assert "crash loop" not in text
    timeline = events(tmp_path)
    assert len([e for e in timeline if e["kind"] == "workers_restarted"]) == 5
    (stopped,) = [e for e in timeline if e["kind"] == "job_stopped"]
    assert stopped["data"]["cause"] == "restart_budget_spent"


def test_crash_loop_rounds_0_restarts_a_crash_before_any_step_until_the_budget_is_spent(
    tmp_path, mark
):
    config = _crashing(tmp_path, "import no_such_module_xyz", crash_loop_rounds=0)
    result = run(tmp_path, mark, str(config), "--set", "job.max_restarts=2")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "restart budget spent (2 of 2 restarts used)" in " ".join(result.stdout.split())
    assert len([e for e in events(tmp_path) if e["kind"] == "workers_restarted"]) == 2


def test_two_outside_kills_of_a_rank_of_a_job_that_reports_no_steps_are_restarted(tmp_path, mark):
    """A script that never reports a step, its rank 0 SIGKILLed from outside in two rounds in a
    row: no crash loop (a kill is no error of its own, and no step is known to have come after
    it), the job restarts it twice and finishes."""
    starts = tmp_path / "starts"
    starts.mkdir()
    code = (
        "import os, pathlib, time\n"
        f"here = pathlib.Path({str(starts)!r})\n"
        "(here / f\"rank-{os.environ['RANK']}-{os.getpid()}\").touch()\n"
        "while not (here / 'done').exists():\n"
        "    time.sleep(0.1)\n"
    )
    command = {"command": [sys.executable, "-c", code], "preload": [], "max_restarts": 5}
    master = start(tmp_path, mark, str(job(tmp_path, job=command)))
    try:
        killed: set[int] = set()

        def started() -> set[int]:
            """Rank 0's start not yet killed; the test fails at once when the job ended."""
            if master.poll() is not None:
                pytest.fail(f"the job ended:\n{master.communicate()[0]}")
            return _rank_0(starts) - killed

        for _ in range(2):
            pid = wait_for("rank 0 starting", started).pop()
            killed.add(pid)
            os.kill(pid, signal.SIGKILL)
        wait_for("rank 0 starting a third time", started)
        (starts / "done").touch()
        output, _ = master.communicate(timeout=120)
    finally:
        if master.poll() is None:
            master.kill()
            master.wait()
    assert master.returncode == 0, output
    assert "crash loop" not in output
    timeline = events(tmp_path)
    restarted = [e for e in timeline if e["kind"] == "workers_restarted"]
    assert len(restarted) == 2, [e["message"] for e in timeline]
    assert not [e for e in timeline if e["kind"] == "job_stopped"]


def _rank_0(starts: Path) -> set[int]:
    """The pids rank 0 has had (each start leaves ``rank-0-PID``)."""
    return {int(p.name.rsplit("-", 1)[1]) for p in starts.glob("rank-0-*")}
