"""A real Slurm cluster for the whole session (``cluster.sh``), an allocation on it that the
scheduler's tests run inside, and a check after every test that the job left nothing behind:
no step, no process, no shared memory (:mod:`planaria.testing.leaks`: only what the test
itself started or created counts).

Every node of the cluster is a host of its own: its slurmd runs in a network namespace with
an address of its own on a bridge (:class:`planaria.testing.netns.Network`), so that nothing
of a job reaches another node on loopback, as nothing does on a real cluster. slurmctld and
munged stay on this machine, which the network joins too (``host=True``): sbatch, srun and
scontrol work from here as from a login node. The namespaces share the filesystem, so the
job directories, munge's socket and /proc are the same on every node.

Processes are found by the session's marker (:mod:`planaria.leftovers`): srun passes the
environment on (``--export=ALL``), so agents and workers that slurmstepd starts carry it. What
the session keeps on purpose (slurmctld, slurmd, munged, the allocation's ``sleep``) is started
without it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from planaria import leftovers
from planaria.testing.jobs import bind_every_interface, final_weights, run_planaria, write_job
from planaria.testing.netns import Network, unavailable

pytest_plugins = ["planaria.testing.leaks"]
"""After every test: nothing it started still runs, nothing it created is left in /dev/shm."""

HERE = Path(__file__).resolve().parent
CLUSTER = HERE / "cluster.sh"
NODES = 4
EXAMPLE = HERE.parents[2] / "examples" / "train_gpt.py"
STEPS = ["--steps", "24", "--ckpt-every", "4", "--out", "final.pt"]


def slurm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=30, check=check)


def unmarked() -> dict[str, str]:
    """The environment for what outlives a test on purpose: without the session's marker."""
    return leftovers.unmarked(os.environ)


@pytest.fixture(scope="session")
def slurm_network() -> Iterator[Network]:
    """The nodes' network: a namespace ``node1`` .. ``node4`` each, and this machine, on one
    bridge. Removed after the cluster stopped (what still runs in a namespace is killed)."""
    why = unavailable()
    if why is not None:
        pytest.skip(f"the test cluster's nodes are network namespaces: {why}")
    with Network([f"node{i}" for i in range(1, NODES + 1)], host=True) as net:
        yield net


@pytest.fixture(scope="session")
def slurm_cluster(slurm_network: Network) -> Iterator[dict[str, str]]:
    """Start a 4-node cluster once, each node in its namespace of ``slurm_network``; its
    environment (SLURM_CONF) goes into os.environ."""
    if shutil.which("slurmctld") is None or shutil.which("srun") is None:
        installed = subprocess.run(
            [str(CLUSTER), "install"], capture_output=True, text=True, env=unmarked()
        )
        if installed.returncode != 0:
            pytest.skip(f"Slurm is not installed and cannot be: {installed.stderr.strip()}")
    hosts = " ".join(f"{m.netns}={m.address}" for m in slurm_network.members.values())
    started = subprocess.run(
        [str(CLUSTER), "start", str(NODES)],
        capture_output=True,
        text=True,
        timeout=120,
        env={  # the daemons outlive every test: without the marker
            **unmarked(),
            "PLANARIA_SLURM_HOSTS": hosts,
            "PLANARIA_SLURM_CONTROLLER": slurm_network.host_address,
        },
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


class Allocations:
    """The batch jobs that hold every node for the tests (shared, surviving a down node).

    A node a test sets down leaves such a job for good (Slurm removes it, the job goes on
    without it), even once the node is back: a module that needs every node of the allocation
    would then find fewer. :meth:`whole` hands out a job that holds every node, a new one when
    the last one lost some."""

    def __init__(self, where: Path) -> None:
        self.where = where
        self.held: list[str] = []

    def whole(self) -> str:
        if self.held and len(nodes_of(self.held[-1])) == NODES:
            return self.held[-1]
        job_id = subprocess.run(
            [
                "sbatch",
                "--parsable",
                f"-N{NODES}",
                "--oversubscribe",
                "--no-kill",
                f"--chdir={self.where}",
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
        self.held.append(job_id)
        wait_running(job_id)
        return job_id

    def cancel(self) -> None:
        for job_id in self.held:
            slurm("scancel", job_id, check=False)


def nodes_of(job_id: str) -> list[str]:
    """The nodes Slurm job ``job_id`` holds now."""
    nodelist = slurm("squeue", "-h", "-j", job_id, "-o", "%N").stdout.strip()
    if not nodelist:
        return []
    return slurm("scontrol", "show", "hostnames", nodelist).stdout.split()


@pytest.fixture(scope="session")
def allocations(
    slurm_cluster: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Allocations]:
    held = Allocations(tmp_path_factory.mktemp("allocation"))
    try:
        yield held
    finally:
        held.cancel()


@pytest.fixture(scope="module")
def allocation(allocations: Allocations) -> str:
    """A job holding every node, whose id tests pass as scheduler.options.job_id: each module
    gets one that holds them all (the same one while no node was set down)."""
    return allocations.whole()


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


def job(where: Path, scheduler: dict[str, object] | None = None, **job: object) -> Path:
    """The training job's file (``examples/train_gpt.py``, 2 nodes of 1 worker); with a
    scheduler (Slurm's), its master binds every interface: it runs on the batch host, a node
    of its own, and finds the address the other nodes reach it at (and serves TLS)."""
    path = write_job(where, "slurm-e2e", [sys.executable, str(EXAMPLE), *STEPS], scheduler, **job)
    return path if scheduler is None else bind_every_interface(path)


@pytest.fixture(scope="session")
def clean_weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """The training job's final weights without a fault, on the local scheduler: what every
    job that lost a node on the cluster must end with, bitwise."""
    pytest.importorskip("torch")
    where = tmp_path_factory.mktemp("clean")
    done = run_planaria(where, "run", str(job(where)))
    assert done.returncode == 0, done.stdout + done.stderr
    return final_weights(where)
