"""The Slurm plugin's job tests' helpers: a job submitted with sbatch and paused mid-training
for a fault from outside, its agent steps, and its output once it ended."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from conftest import job, slurm

from planaria.testing.jobs import run_planaria, wait_for, with_sections


def job_state(job_id: str) -> str:
    return slurm("squeue", "-h", "-j", job_id, "-o", "%T", check=False).stdout.strip()


def steps(job_id: str) -> dict[str, tuple[str, str]]:
    """Step name -> (step id, node) of the job's agent steps."""
    out = slurm("squeue", "-h", "-s", "-j", job_id, "-o", "%i|%j|%N", check=False).stdout
    found = {}
    for line in out.splitlines():
        step, name, node = line.split("|")
        if name.startswith("planaria.") and ".cleanup." not in name:
            found[name] = (step, node)
    return found


def submit_and_pause(
    where: Path,
    standby: int = 0,
    nodes: int = 2,
    sets: Sequence[str] = (),
    **sections: object,
) -> tuple[str, dict[str, tuple[str, str]]]:
    """Submit the job (``nodes`` and a spare, 3 by default; ``standby`` more, ``job.standby``;
    ``sets``: more ``--set`` values; ``sections`` merged into its file) with rank 0 stopping
    itself at step 10, so that a fault from outside lands mid-training; returns the Slurm job
    id and its agent steps."""
    scheduler = {"backend": "slurm", "options": {"spares": 1, "sbatch": ["--oversubscribe"]}}
    config = with_sections(job(where, scheduler, standby=standby, nodes=nodes), **sections)
    chaos = ["--set", 'chaos=[{"kind": "stop_worker", "rank": 0, "at_step": 10}]']
    for value in sets:
        chaos += ["--set", value]
    submitted = run_planaria(where, "submit", str(config), *chaos)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    job_id = submitted.stdout.split()[-1]
    assert job_id.isdigit(), submitted.stdout
    wait_for("the job's start", lambda: job_state(job_id) == "RUNNING")
    allocated = slurm("squeue", "-h", "-j", job_id, "-o", "%D").stdout.strip()
    assert allocated == str(nodes + 1 + standby), allocated

    def paused() -> bool:
        return any("stop_worker" in p.read_text() for p in where.glob("planaria-runs/*/logs/*.log"))

    wait_for("rank 0 pausing at step 10", paused)
    return job_id, steps(job_id)


def finish(where: Path, job_id: str) -> str:
    wait_for("the job's end", lambda: job_state(job_id) == "", timeout=240)
    (output,) = where.glob(".planaria/slurm-*.out")
    return output.read_text()
