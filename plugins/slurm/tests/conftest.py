"""A real Slurm cluster for the whole session (``cluster.sh``), an allocation on it that the
scheduler's tests run inside, and a check after every test that the job left nothing behind:
no step, no process, no shared memory (:mod:`planaria.testing.leaks`: only what the test
itself started or created counts).

Processes are found by the session's marker (:mod:`planaria.leftovers`): srun passes the
environment on (``--export=ALL``), so agents and workers that slurmstepd starts carry it. What
the session keeps on purpose (slurmctld, slurmd, munged, the allocation's ``sleep``) is started
without it."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from planaria import leftovers

pytest_plugins = ["planaria.testing.leaks"]
"""After every test: nothing it started still runs, nothing it created is left in /dev/shm."""

HERE = Path(__file__).resolve().parent
CLUSTER = HERE / "cluster.sh"
NODES = 4


def slurm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=30, check=check)


def unmarked() -> dict[str, str]:
    """The environment for what outlives a test on purpose: without the session's marker."""
    return leftovers.unmarked(os.environ)


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[dict[str, str]]:
    """Start a 4-node cluster once; its environment (SLURM_CONF) goes into os.environ."""
    if shutil.which("slurmctld") is None or shutil.which("srun") is None:
        installed = subprocess.run(
            [str(CLUSTER), "install"], capture_output=True, text=True, env=unmarked()
        )
        if installed.returncode != 0:
            pytest.skip(f"Slurm is not installed and cannot be: {installed.stderr.strip()}")
    started = subprocess.run(
        [str(CLUSTER), "start", str(NODES)],
        capture_output=True,
        text=True,
        timeout=120,
        env=unmarked(),  # the daemons outlive every test
    )
    if started.returncode != 0:
        pytest.fail(f"cluster.sh start failed:\n{started.stderr}")
    env = {}
    for line in started.stdout.splitlines():
        if line.startswith("export "):
            name, _, value = line[len("export ") :].partition("=")
            env[name] = value
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield env
    finally:
        subprocess.run(
            [str(CLUSTER), "stop"], capture_output=True, text=True, timeout=120, env=unmarked()
        )
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed job test shows what the cluster and the job saw: the batch output, each run's
    timeline and the tail of slurmctld's log (a flake on a loaded machine leaves nothing else)."""
    report = yield
    where = getattr(item, "funcargs", {}).get("tmp_path")
    if report.when == "call" and report.failed and isinstance(where, Path):
        for path in sorted(where.glob("**/.planaria/slurm-*.out")):
            report.sections.append((f"batch output {path.name}", path.read_text()[-6000:]))
        for path in sorted(where.glob("**/planaria-runs/*/events.jsonl")):
            lines = path.read_text().splitlines()[-80:]
            report.sections.append((f"timeline {path.parent.name}", "\n".join(lines)))
        ctld = Path(os.environ.get("PLANARIA_SLURM_DIR", "/tmp/planaria-slurm"), "log")
        for path in sorted(ctld.glob("slurmctld.log")):
            tail = "\n".join(path.read_text(errors="replace").splitlines()[-60:])
            report.sections.append(("slurmctld.log", tail))
    return report


def wait_running(job_id: str, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        state = slurm("squeue", "-h", "-j", job_id, "-o", "%T").stdout.strip()
        if state == "RUNNING":
            return state
        if time.monotonic() > deadline:
            pytest.fail(f"Slurm job {job_id} is {state or 'gone'}, not running, after {timeout}s")
        time.sleep(0.2)


@pytest.fixture(scope="session")
def allocation(
    slurm_cluster: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A job holding every node (shared, surviving a down node) whose id tests pass as
    scheduler.options.job_id; cancelled at the end."""
    where = tmp_path_factory.mktemp("allocation")
    job_id = subprocess.run(
        [
            "sbatch",
            "--parsable",
            f"-N{NODES}",
            "--oversubscribe",
            "--no-kill",
            f"--chdir={where}",
            "--output=/dev/null",
            "--job-name=planaria-tests",
            "--wrap",
            "exec sleep infinity",  # it lives as long as the session: sbatch without the marker
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
        env=unmarked(),
    ).stdout.strip()
    try:
        wait_running(job_id)
        yield job_id
    finally:
        slurm("scancel", job_id, check=False)


def job_steps(job_id: str) -> list[str]:
    out = slurm("squeue", "-h", "-s", "-j", job_id, "-o", "%i|%j", check=False).stdout
    return [line for line in out.splitlines() if line and ".batch" not in line]


@pytest.fixture(autouse=True)
def leaves_nothing(request: pytest.FixtureRequest, nothing_left_running: None) -> Iterator[None]:
    """After a test that used the cluster: no step of the allocation. It asks for
    ``nothing_left_running`` so that the steps get their time to end before the processes and
    the shared memory are looked for (:mod:`planaria.testing.leaks`)."""
    yield
    if "allocation" not in request.fixturenames:
        return
    job_id = request.getfixturevalue("allocation")
    deadline = time.monotonic() + 20
    while (steps := job_steps(job_id)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not steps, f"steps of the job left running: {steps}"
