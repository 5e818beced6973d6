"""``planaria run --rdzv-endpoint HOST:PORT`` on every node, torchrun's way: real launchers,
each in a network namespace of its own with its own address (no 127.0.0.1), started by the
test as srun would start them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from planaria.testing.jobs import EXAMPLE, planaria_command, weights

TOKEN = "c0ffee" * 6
PORT = 29411
SETTINGS = (
    "--set",
    "rendezvous.join_grace=2s",
    "--set",
    "rendezvous.join_timeout=90s",
    "--set",
    "master.heartbeat_interval=1s",
    "--set",
    "master.heartbeat_timeout=6s",
    "--set",
    "diagnosis.checks=[]",
)


def _launcher(
    net, name: str, tmp_path: Path, mark: str, args: list[str], token: str = TOKEN
) -> subprocess.Popen[str]:
    """One node's ``planaria run``, in its own namespace and process group (as srun starts a
    task), its output in ``<name>.out``."""
    argv, env = planaria_command(mark, tuple(args))
    env["PLANARIA_TOKEN"] = token
    out = (tmp_path / f"{name}.out").open("w")
    return subprocess.Popen(
        net.exec(name, argv),
        cwd=tmp_path,
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _line(endpoint: str, nnodes: str, *script: str) -> list[str]:
    return [
        "--nnodes",
        nnodes,
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        *SETTINGS,
        str(EXAMPLE),
        *script,
    ]


def _wait(procs: list[subprocess.Popen[str]], timeout: float = 300) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            codes.append(proc.wait())
    return codes


def _events(workdir: Path) -> list[dict]:
    (timeline,) = workdir.glob("planaria-runs/*/events.jsonl")
    return [json.loads(line) for line in timeline.read_text().splitlines()]


def _output(tmp_path: Path, *names: str) -> str:
    return "\n".join(f"--- {n}\n{(tmp_path / f'{n}.out').read_text()}" for n in names)


def _two_launchers(net, workdir: Path, mark: str, nnodes: str, script: list[str], chaos=()):
    endpoint = f"{net.address('head')}:{PORT}"
    extra = [a for rule in chaos for a in ("--chaos", rule)]
    head = _launcher(net, "head", workdir, mark, [*extra, *_line(endpoint, nnodes, *script)])
    other = _launcher(net, "other", workdir, mark, _line(endpoint, nnodes, *script))
    return head, other


def test_two_launchers_train_through_a_worker_kill_bitwise_as_without(tmp_path, mark, network):
    net = network("head", "other")
    script = ["--steps", "16", "--ckpt-every", "4", "--out", "final.pt"]
    clean, faulty = tmp_path / "clean", tmp_path / "faulty"
    for workdir in (clean, faulty):
        workdir.mkdir()
    codes = _wait(list(_two_launchers(net, clean, mark, "2", script)))
    assert codes == [0, 0], _output(clean, "head", "other")

    rule = "kill_worker rank=3 at_step=6"
    codes = _wait(list(_two_launchers(net, faulty, mark, "2", script, chaos=[rule])))
    output = _output(faulty, "head", "other")
    assert codes == [0, 0], output
    head_out = (faulty / "head.out").read_text()
    assert f"master at https://{net.address('head')}:{PORT}" in head_out
    assert (
        f"joining the job master at https://{net.address('head')}:{PORT}"
        in (faulty / "other.out").read_text()
    )
    timeline = _events(faulty)
    (started,) = [e for e in timeline if e["kind"] == "job_started"]
    assert started["message"].endswith("1 node(s) started here, 2 in all expected to join")
    nodes = {e["node"] for e in timeline if e.get("node")}
    assert {f"node-{net.address('head')}", f"node-{net.address('other')}"} <= nodes, nodes
    rounds = [e for e in timeline if e["kind"] == "rendezvous_completed"]
    assert len(rounds) >= 2 and all("world size 4" in e["message"] for e in rounds), rounds
    kills = [e for e in timeline if e["kind"] == "fault_detected"]
    assert any(e["data"].get("signal") == 9 for e in kills), kills
    assert [e for e in timeline if e["kind"] == "recovered"]
    # Never the loopback: every node reached the master, and its peers, by its own address.
    assert "127.0.0.1" not in json.dumps(timeline)

    a, b = weights(next(clean.glob("**/final.pt"))), weights(next(faulty.glob("**/final.pt")))
    assert a.keys() == b.keys()
    assert all(a[k].equal(b[k]) for k in a)


def test_a_launcher_with_another_token_is_refused_clearly(tmp_path, mark, network):
    net = network("head", "other")
    endpoint = f"{net.address('head')}:{PORT}"
    line = [*_line(endpoint, "2", "--steps", "4"), "--set", "rendezvous.join_timeout=20s"]
    head = _launcher(net, "head", tmp_path, mark, line)
    other = _launcher(net, "other", tmp_path, mark, line, token="f00d" * 8)
    assert _wait([other], timeout=120) == [2]
    said = (tmp_path / "other.out").read_text()
    assert "does not hold this launcher's token (PLANARIA_TOKEN)" in " ".join(said.split())
    # The master never heard from it: nothing of the job was sent before the proof failed.
    assert _wait([head], timeout=120) == [1]
    timeline = _events(tmp_path)
    assert not [e for e in timeline if e["kind"] == "registration_refused"]
    assert "needs at least 2" in (tmp_path / "head.out").read_text() or any(
        e["kind"] == "job_stopped" for e in timeline
    )


def test_a_launcher_without_a_token_says_how_to_set_one(tmp_path, mark):
    argv, env = planaria_command(mark, ("--nnodes", "2", "--rdzv-endpoint", "10.0.0.1:1", "x.py"))
    env.pop("PLANARIA_TOKEN", None)
    result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode == 2
    said = " ".join(result.stderr.split())
    assert "export PLANARIA_TOKEN=$(python -c 'import secrets;print(secrets.token_hex(16))')" in (
        said
    )


def test_the_job_shrinks_when_a_node_s_launcher_is_killed_and_grows_when_it_is_back(
    tmp_path, mark, network
):
    net = network("head", "other")
    script = ["--steps", "1500", "--ckpt-every", "20"]
    endpoint = f"{net.address('head')}:{PORT}"
    head, other = _two_launchers(net, tmp_path, mark, "1:2", script)
    _until(tmp_path, [head, other], lambda e: e["kind"] == "checkpoint_committed", "a checkpoint")
    killed_at = time.time()
    os.killpg(other.pid, signal.SIGKILL)  # the node is gone: its launcher, agent, workers
    other.wait()
    _until(
        tmp_path,
        [head],
        lambda e: e["time"] >= killed_at and "world size 2;" in e["message"],
        "a round without the node",
    )
    # srun --requeue: the same launcher again, the same line; it takes its old slot.
    (tmp_path / "other.out").rename(tmp_path / "other-1.out")
    again = _launcher(net, "other", tmp_path, mark, _line(endpoint, "1:2", *script))
    assert _wait([head, again], timeout=400) == [0, 0], _output(tmp_path, "head", "other")
    timeline = _events(tmp_path)
    lost = [e for e in timeline if e["kind"] == "fault_detected" and "lost" in e["message"]]
    assert [e["node"] for e in lost] == [f"node-{net.address('other')}"], lost
    (kept,) = [e for e in timeline if e["kind"] == "node_replaced"]
    assert "slot is kept open for it to come back" in kept["message"], kept
    # After the loss: a round without the node (shrunk), then one with it again (grown).
    after = [e for e in timeline if e["time"] >= killed_at]
    sizes = [e["data"]["world_size"] for e in after if e["kind"] == "rendezvous_completed"]
    assert 2 in sizes and sizes[-1] == 4 and sizes.index(2) < len(sizes) - 1, sizes
    (finished,) = [e for e in timeline if e["kind"] == "job_finished"]
    assert finished["data"]["state"] == "succeeded"


def _until(
    workdir: Path,
    procs: list[subprocess.Popen[str]],
    seen: Callable[[dict], bool],
    what: str,
    timeout: float = 180,
) -> None:
    """Wait until an event of the job's timeline is ``seen``, while ``procs`` run."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runs = list(workdir.glob("planaria-runs/*/events.jsonl"))
        if runs:
            lines = runs[0].read_text().splitlines()
            if any(seen(json.loads(line)) for line in lines if line.endswith("}")):
                return
        assert all(p.poll() is None for p in procs), _output(workdir, "head", "other")
        time.sleep(0.5)
    pytest.fail(f"no {what} within {timeout} s:\n" + _output(workdir, "head"))
