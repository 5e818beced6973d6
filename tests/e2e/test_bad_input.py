"""Bad input at load and launch time: each is a clear error, exit 2, naming what is wrong and
where (the config path, and the line when it comes from the file), and nothing is left
running: no agent, worker or persister, nothing in /dev/shm.

The runs are marked through their environment (see ``test_run``); after each, no process of
the job may be alive.
"""

from __future__ import annotations

import os
import re
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from conftest import PLUGIN_FIXTURES, planaria_executable

from planaria.capacity import WORKERS_PER_CPU, usable_cpus
from planaria.config import load
from planaria.errors import ConfigError, SchedulerError
from planaria.master.transport import is_loopback, transport
from planaria.testing.jobs import MARK, events, marked_processes
from support.cli import problems
from support.scheduler import Harness, our_children

QUICK = [sys.executable, "-c", "pass"]


def config(tmp_path: Path, **sections: object) -> Path:
    """A one-node job that does nothing, quickly, with the given sections merged in."""
    data: dict[str, object] = {
        "job": {"name": "bad", "command": QUICK, "preload": [], "max_restarts": 3},
        "rendezvous": {"join_grace": "500ms", "join_timeout": "60s"},
        "master": {"heartbeat_interval": "1s"},
        "diagnosis": {"checks": []},
    }
    for name, value in sections.items():
        old = data.get(name)
        merge = isinstance(old, dict) and isinstance(value, dict)
        data[name] = {**old, **value} if merge else value  # type: ignore[dict-item]
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def planaria(
    tmp_path: Path,
    mark: str,
    *args: str,
    plugins: tuple[str, ...] = (),
    timeout: float = 120,
    limit_memory: int | None = None,
) -> subprocess.CompletedProcess[str]:
    """The real ``planaria`` command in ``tmp_path``, marked; ``limit_memory``: its address
    space in bytes (RLIMIT_AS), so that a runaway allocation fails instead of swapping."""

    def limit() -> None:
        if limit_memory is not None:
            resource.setrlimit(resource.RLIMIT_AS, (limit_memory, limit_memory))

    return subprocess.run(
        [planaria_executable(), *args],
        cwd=tmp_path,
        env=_env(mark, plugins),
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=limit,
    )


def _env(mark: str, plugins: tuple[str, ...] = ()) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PLANARIA_DISABLE_PLUGINS"}
    env.update(
        {
            MARK: mark,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            "COLUMNS": "200",
        }
    )
    if plugins:
        extra = [str(PLUGIN_FIXTURES / p) for p in plugins]
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [*extra, env.get("PYTHONPATH")]))
    return env


def flat(result: subprocess.CompletedProcess[str]) -> str:
    return " ".join((result.stdout + result.stderr).split())


def assert_usage_error(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    text = flat(result)
    assert result.returncode == 2, text
    assert "Traceback" not in text, text
    for fragment in fragments:
        assert fragment in text, text


def runs(tmp_path: Path) -> list[Path]:
    return sorted(tmp_path.glob("planaria-runs/*"))


def at(path: Path, key: str) -> str:
    """``(line N)``: where ``key:`` is first spelled out in the file."""
    for number, text in enumerate(path.read_text().splitlines(), 1):
        if text.strip().startswith(f"{key}:"):
            return f"(line {number})"
    raise AssertionError(f"{key} is not in {path}")


# -- case: a node count no machine has, and the launch that cannot be stopped ------------------


def test_a_node_count_beyond_any_cluster_is_a_config_error(tmp_path, mark):
    path = config(tmp_path, job={"nodes": 99999999999999999999})
    result = planaria(tmp_path, mark, "run", str(path))
    assert_usage_error(result, f"job.nodes {at(path, 'nodes')}: at most 100000 nodes")
    assert runs(tmp_path) == []


def test_the_local_scheduler_refuses_more_nodes_than_this_machine_runs(tmp_path, mark):
    limit = max(8, 4 * usable_cpus())
    path = config(tmp_path, job={"nodes": limit + 1})
    result = planaria(tmp_path, mark, "config", "validate", str(path))
    assert_usage_error(
        result,
        f"job.nodes {at(path, 'nodes')}: {limit + 1} nodes are more than the local scheduler "
        "runs on this "
        f"machine: at most {limit}",
        "scheduler.options.max_nodes",
    )
    result = planaria(tmp_path, mark, "run", str(path))
    assert_usage_error(result, f"at most {limit}")
    assert runs(tmp_path) == []


def test_a_local_launch_past_max_nodes_starts_nothing(harness: Harness) -> None:
    scheduler = harness.scheduler(max_nodes=2)
    spec = harness.spec("time.sleep(60)")
    with pytest.raises(SchedulerError, match="at most 2 on this machine"):
        scheduler.launch(spec, 3)
    assert len(scheduler.launch(spec, 2)) == 2
    with pytest.raises(SchedulerError, match="cannot launch 1 more node"):
        scheduler.launch(spec, 1)


def test_interrupt_stops_a_local_launch_between_two_nodes(harness: Harness) -> None:
    count = 40
    scheduler = harness.scheduler(max_nodes=count)
    logs = harness.tmp / "logs"
    spec = harness.spec("time.sleep(60)", log_dir=str(logs))
    outcome: list[BaseException | int] = []

    def launch() -> None:  # twice: the interrupted launch, then one after the interrupt
        for asked in (count, 1):
            try:
                outcome.append(len(scheduler.launch(spec, asked)))
            except BaseException as exc:
                outcome.append(exc)

    thread = threading.Thread(target=launch)
    thread.start()
    deadline = time.monotonic() + 30
    while not (logs / "node-0.log").exists():
        assert time.monotonic() < deadline, "no node started"
        time.sleep(0.001)
    scheduler.interrupt()
    thread.join(30)
    result, after = outcome
    assert isinstance(result, SchedulerError), result
    assert "launching stopped after" in str(result)
    assert isinstance(after, SchedulerError) and "the job is stopping" in str(after), after
    started = len(list(logs.glob("node-*.log")))
    assert started < count, "the launch went on after the interrupt"
    assert our_children() == [], "all or nothing: what the launch had started is not gone"


def test_sigterm_while_nodes_are_launched_stops_the_launch_and_every_agent(tmp_path, mark):
    nodes = 8
    path = config(
        tmp_path,
        job={"nodes": nodes, "command": [sys.executable, "-c", "import time; time.sleep(30)"]},
        scheduler={
            "backend": "slowlaunch",
            "options": {"max_nodes": nodes, "seconds_per_node": 0.5},
        },
        rendezvous={"join_grace": "500ms", "join_timeout": "60s"},
    )
    proc = subprocess.Popen(
        [planaria_executable(), "run", str(path)],
        cwd=tmp_path,
        env=_env(mark, ("slowlaunch",)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob("planaria-runs/*/logs/agents/node-0.log")):
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "no node was launched"
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    text = " ".join(output.split())
    assert proc.returncode == 143, text  # 128 + SIGTERM, as a shell reports it
    assert "failed: interrupted by SIGTERM" in text, text
    (run_dir,) = runs(tmp_path)
    launched = sorted(p.stem for p in (run_dir / "logs" / "agents").glob("node-*.log"))
    assert len(launched) < nodes, f"the launch went on after SIGTERM: {launched}"
    kinds = [e["kind"] for e in events(tmp_path)]
    assert "rendezvous_completed" not in kinds and "job_started" not in kinds, kinds


# -- case: a YAML alias bomb -------------------------------------------------------------------

BOMB = "".join(
    f"{name}: &{name} [{','.join([f'*{prev}' if prev else 'x'] * 10)}]\n"
    for prev, name in zip(["", *"abcdefgh"], "abcdefghi", strict=True)
)


def test_an_alias_bomb_is_refused_in_bounded_memory(tmp_path, mark):
    assert len(BOMB) < 400
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB)
    for command in ("config validate", "run"):
        result = planaria(
            tmp_path, mark, *command.split(), str(path), timeout=60, limit_memory=1 << 30
        )
        assert_usage_error(
            result,
            "bomb.yaml (1 problem)",
            "(line 4): YAML aliases (here *c) expand the file by more than 10000 values",
        )


def test_an_alias_inside_its_own_value_and_deep_nesting_are_config_errors(tmp_path):
    assert problems(tmp_path, "job:\n  env: &e {A: *e}\n") == [
        "job.env.A (line 2): the alias *e is inside the value it names, which would never "
        "end; write the value out instead"
    ]
    deep = "job:\n  env: " + "[" * 5000 + "]" * 5000 + "\n"
    (issue,) = problems(tmp_path, deep)
    assert "(line 2): nested more than 64 levels deep" in issue
    toml = tmp_path / "deep.toml"
    toml.write_text("a = " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError, match="nested too deeply"):
        load(toml)


def test_an_alias_bomb_in_an_override_is_refused(tmp_path):
    value = BOMB.replace("\n", ", ").replace(": &", ": &")
    (issue,) = problems(tmp_path, "job: {}\n", [f"job.env={{{value}}}"])
    assert "expand the file by more than 10000 values" in issue


def test_anchors_and_merge_keys_still_work(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(
        "job:\n"
        "  command: &cmd [python, -c, pass]\n"
        "  env:\n    <<: &base {A: '1', B: '2'}\n    B: '9'\n    C: '3'\n"
        "  preload: *cmd\n"
    )
    resolved, _ = load(path)
    assert resolved.config.job.env == {"A": "1", "B": "9", "C": "3"}
    assert resolved.config.job.preload == ["python", "-c", "pass"]


def test_a_value_python_cannot_build_is_a_config_error(tmp_path):
    (issue,) = problems(tmp_path, "job:\n  nodes: " + "9" * 5000 + "\n")
    assert issue.startswith("<top level> (line 2): cannot read '999")
    assert "Exceeds the limit (4300 digits)" in issue and "set_int_max_str_digits" not in issue


# -- case: a worker that cannot start ----------------------------------------------------------


@pytest.mark.parametrize(
    ("job", "fragment"),
    [
        ({"env": {"FOO": "a\0b"}}, "job.env {env}: the value of FOO holds a NUL byte"),
        ({"env": {"A=B": "x"}}, "job.env {env}: invalid variable name 'A=B'"),
        ({"command": ["python", "a\0b"]}, "job.command {command}: argument 1 ('a\\x00b')"),
        ({"env": {"BIG": "x" * 200_000}}, "job.env {env}: BIG='xxxxxxxxxxxxxxxxxxxx'... "),
        (
            {"env": {f"V{i}": "x" * 100_000 for i in range(100)}},
            "job {job}: the command and env take 10001",
        ),
    ],
)
def test_what_no_program_can_be_given_is_refused_at_load(tmp_path, job, fragment):
    path = config(tmp_path, job=job)
    with pytest.raises(ConfigError) as exc:
        load(path)
    lines = {key: at(path, key) for key in ("job", "command", "env") if key in fragment}
    assert fragment.format(**lines) in str(exc.value)


def test_a_program_missing_here_is_a_config_error_before_any_agent_starts(tmp_path, mark):
    path = config(tmp_path, job={"command": ["/nonexistent/prog", "--x"]})
    result = planaria(tmp_path, mark, "run", str(path))
    assert_usage_error(
        result, f"job.command {at(path, 'command')}: '/nonexistent/prog' is not an executable file"
    )
    assert runs(tmp_path) == []
    path = config(tmp_path, job={"command": ["no-such-program-here"]})
    result = planaria(tmp_path, mark, "run", str(path))
    assert_usage_error(result, "'no-such-program-here' is not an executable file on the PATH")
    path = config(tmp_path, job={"command": [sys.executable, "missing.py"]})
    result = planaria(tmp_path, mark, "run", str(path))
    assert_usage_error(result, f"the script 'missing.py' does not exist in {tmp_path}")


def test_workers_that_cannot_start_stop_the_job_with_the_reason(tmp_path, mark):
    # The script exists and is executable, but its interpreter does not: only exec says so.
    script = tmp_path / "train.sh"
    script.write_text("#!/nonexistent/interpreter\necho never\n")
    script.chmod(0o755)
    path = config(tmp_path, job={"command": ["./train.sh"], "nodes": 2})
    result = planaria(tmp_path, mark, "run", str(path))
    reason = "cannot start './train.sh': [Errno 2] No such file or directory"
    assert_usage_error(result, reason)
    # Whichever node reports first stops the job; the other's report is in the timeline.
    assert re.search(
        rf"failed: user error: rank \d \(node node-\d\) {re.escape(reason)}", flat(result)
    )
    timeline = events(tmp_path)
    kinds = [e["kind"] for e in timeline]
    assert kinds.count("job_stopped") == 1
    assert "node_replaced" not in kinds and "workers_restarted" not in kinds, kinds
    failed = [e for e in timeline if e["kind"] == "fault_detected"]
    assert failed and all(e["data"]["classified_by"] == "start" for e in failed)
    assert failed[0]["data"]["fault_class"] == "user"
    (stopped,) = [e for e in timeline if e["kind"] == "job_stopped"]
    assert stopped["data"]["cause"] == "cannot_start"
    (run_dir,) = runs(tmp_path)
    agents = sorted(p.name for p in (run_dir / "logs" / "agents").iterdir())
    assert agents == ["node-0.log", "node-1.log"], agents
    assert "Task exception" not in flat(result)


def test_a_loss_that_spends_the_budget_asks_for_no_replacement(tmp_path, mark):
    path = config(
        tmp_path,
        job={"command": [sys.executable, "-c", "import time; time.sleep(30)"], "max_restarts": 0},
        chaos=[{"kind": "kill_node", "node_rank": 0, "after": "1s"}],
    )
    result = planaria(tmp_path, mark, "run", str(path))
    text = flat(result)
    assert result.returncode == 1, text
    assert "restart budget spent (0 of 0 restarts used)" in text
    (run_dir,) = runs(tmp_path)
    agents = sorted(p.name for p in (run_dir / "logs" / "agents").iterdir())
    assert agents == ["node-0.log"], f"a node was started after the job stopped: {agents}"
    assert "replacement failed" not in text and "Task exception" not in text, text
    assert "node_replaced" not in [e["kind"] for e in events(tmp_path)]


# -- case: more workers than a node has ---------------------------------------------------------


def test_a_worker_count_beyond_any_node_is_a_config_error(tmp_path):
    (issue,) = problems(tmp_path, "job:\n  procs_per_node: 10000\n")
    assert issue.startswith("job.procs_per_node (line 2): Input should be less than or equal")


def test_the_local_scheduler_refuses_more_workers_than_this_machine_has(tmp_path, mark):
    procs = WORKERS_PER_CPU * usable_cpus() + 1
    if procs > 1024:
        pytest.skip("this machine takes every worker count the schema allows")
    path = config(tmp_path, job={"procs_per_node": procs})
    result = planaria(tmp_path, mark, "run", str(path))
    assert_usage_error(
        result,
        f"job.procs_per_node {at(path, 'procs_per_node')}: 1 node(s) x {procs} worker(s) all "
        "run on this machine, "
        f"and {procs} workers are more than this machine can train with: it has "
        f"{usable_cpus()} CPU(s)",
    )
    assert runs(tmp_path) == []


def test_a_node_smaller_than_asked_stops_the_job_with_the_reason(tmp_path, mark):
    if usable_cpus() < 2:
        pytest.skip("needs a machine where the job fits but a one-CPU node does not")
    procs = WORKERS_PER_CPU + 1
    path = config(tmp_path, job={"procs_per_node": procs})
    proc = subprocess.Popen(
        [planaria_executable(), "run", str(path)],
        cwd=tmp_path,
        env=_env(mark),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    # The node gets one CPU: its agent (the same pid from fork on) is pinned to CPU 0 before
    # it has even imported planaria, long before it starts workers.
    pinned: set[int] = set()
    try:
        while proc.poll() is None and not pinned:
            for pid in marked_processes(mark):
                try:
                    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                    if b"PLANARIA_NODE_ID=node-0" in environ:
                        os.sched_setaffinity(pid, {min(os.sched_getaffinity(0))})
                        pinned.add(pid)
                except OSError:
                    continue
            time.sleep(0.005)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    text = " ".join(output.split())
    assert pinned, text
    assert proc.returncode == 2, text
    assert (
        f"failed: user error: rank 0 (node node-0) cannot start {procs} workers on this node: "
        f"{procs} workers are more than this machine can train with: it has 1 CPU(s)"
    ) in text
    assert not list(tmp_path.glob("planaria-runs/*/logs/rank-*.log")), "a worker started"


# -- case: an unwritable run directory, a port in use --------------------------------------------


def test_a_run_dir_that_cannot_be_created_is_a_config_error(tmp_path, mark):
    (tmp_path / "a-file").write_text("not a directory\n")  # root or not: nothing goes inside
    path = config(tmp_path, job={"run_dir": "a-file/runs"})
    result = planaria(tmp_path, mark, "run", str(path))
    assert_usage_error(
        result,
        f"job.run_dir {at(path, 'run_dir')}: cannot create the run directory "
        f"{tmp_path}/a-file/runs/",
        ": Not a directory; set job.run_dir to a directory this user can write",
    )


def test_a_master_port_in_use_is_a_config_error(tmp_path, mark):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        path = config(tmp_path, master={"port": port})
        result = planaria(tmp_path, mark, "run", str(path))
    assert_usage_error(
        result,
        f"master.port {at(path, 'port')}: the master cannot listen on 127.0.0.1:{port}",
        "address already in use; choose another master.port, or 0 for any free one",
    )
    assert runs(tmp_path) == [], "the run that could not start left its directory"


# -- case: a workdir that does not exist ---------------------------------------------------------


def test_a_missing_workdir_is_a_config_error_and_is_not_created(tmp_path, mark):
    missing = tmp_path / "no" / "such" / "dir"
    path = config(tmp_path, job={"workdir": str(missing)})
    result = planaria(tmp_path, mark, "run", str(path))
    assert_usage_error(result, f"job.workdir {at(path, 'workdir')}: {missing} does not exist")
    assert not (tmp_path / "no").exists()
    (tmp_path / "file").write_text("")
    path = config(tmp_path, job={"workdir": str(tmp_path / "file")})
    result = planaria(tmp_path, mark, "run", str(path))
    assert_usage_error(
        result, f"job.workdir {at(path, 'workdir')}: {tmp_path / 'file'} is not a directory"
    )


# -- case: the API on a network address --------------------------------------------------------


def test_plain_http_beyond_loopback_is_warned_about(tmp_path, mark):
    path = config(tmp_path, master={"host": "0.0.0.0", "advertise": "127.0.0.1", "tls": False})
    result = planaria(tmp_path, mark, "run", str(path))
    assert result.returncode == 0, flat(result)
    assert "master at http://127.0.0.1:" in result.stdout
    warning = (
        "warning: the master's API listens on 0.0.0.0 (master.host), beyond this machine, over "
        "plain HTTP (master.tls: false): the job's token and every request travel unencrypted"
    )
    assert warning in " ".join(result.stderr.split())
    quiet = planaria(tmp_path, mark, "run", str(config(tmp_path)))
    assert quiet.returncode == 0, flat(quiet)
    assert "warning:" not in quiet.stderr


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        *[("127.0.0.1", True), ("::1", True), ("localhost", True), ("127.1.2.3", True)],
        *[("0.0.0.0", False), ("::", False), ("", False), ("192.0.2.7", False)],
    ],
)
def test_which_hosts_keep_the_api_on_this_machine(host, loopback):
    assert is_loopback(host) is loopback
    wire = transport(host)
    assert wire.scheme == ("http" if loopback else "https")
    assert wire.warning is None
    assert transport(host, tls=True).scheme == "https"
    assert transport(host, tls=True).warning is None
    plain = transport(host, tls=False)
    assert plain.scheme == "http"
    assert (plain.warning is None) is loopback
