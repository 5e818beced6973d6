"""What a user sees from ``planaria submit`` and ``planaria run`` with the slurm scheduler: the
batch script, and one clear error (exit 2, Slurm's own message) for every way it cannot go;
and the job token, which nothing but the agents' environment may show."""

from __future__ import annotations

import os
import secrets
import socket
import sys
from pathlib import Path

import pytest
from conftest import job, slurm
from planaria_slurm import SlurmOptions, SlurmScheduler

from planaria.plugin import LaunchSpec, NodeState
from planaria.testing.jobs import run_planaria, wait_for
from planaria.testing.processes import processes_with


@pytest.mark.usefixtures("slurm_cluster")
def test_dry_run_prints_the_batch_script(tmp_path: Path) -> None:
    options = {
        "spares": 2,
        "partition": "debug",
        "time": "01:00:00",
        "account": "ml",
        "gpus_per_node": "8",
        "constraint": "a100&ib",
        "requeue": True,
        "sbatch": ["--qos=high"],
    }
    config = job(tmp_path, {"backend": "slurm", "options": options}, nodes="2:4")
    (tmp_path / ".planaria").mkdir()
    (tmp_path / ".planaria" / "slurm-bad-nodes").write_text("node9 ECC errors\nnode3 lost\n")
    done = run_planaria(tmp_path, "submit", "--dry-run", str(config), "--set", "job.max_restarts=5")
    assert done.returncode == 0, done.stderr
    script = done.stdout
    assert script.startswith("#!/bin/sh\n")
    for line in [
        "#SBATCH --job-name=slurm-e2e",
        "#SBATCH --nodes=6",  # 4 at most, 2 spares
        "#SBATCH --no-kill",
        f"#SBATCH --output={tmp_path}/.planaria/slurm-%j.out",
        "#SBATCH --partition=debug",
        "#SBATCH --time=01:00:00",
        "#SBATCH --account=ml",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --constraint=a100&ib",
        "#SBATCH --exclude=node3,node9",
        "#SBATCH --requeue",
        "#SBATCH --qos=high",
    ]:
        assert line + "\n" in script, f"{line!r} missing from:\n{script}"
    assert "--chdir" not in script  # sbatch runs where the submission is made
    lines = script.strip().splitlines()
    assert f"cd -- {tmp_path} || exit 1" in lines
    assert lines[-6] == (
        f"if PLANARIA_MASTER_ADVERTISE=$({sys.executable} -m planaria_slurm.address); then"
    )
    last = lines[-1]
    assert last == (
        f"exec {sys.executable} -m planaria run {config} --set job.max_restarts=5 "
        f"--set scheduler.options.state_dir={tmp_path}/.planaria"
    )
    assert not list(tmp_path.glob(".planaria/submit-*")), "a dry run writes no script file"


def _no_controller(where: Path) -> dict[str, str]:
    """The environment of a Slurm client whose controller is at a port where nothing listens
    (a laptop, a login node while slurmctld is down): any sinfo would fail."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    conf = where / "slurm.conf"
    conf.write_text(
        "ClusterName=nowhere\n"
        "SlurmctldHost=localhost(127.0.0.1)\n"
        f"SlurmctldPort={port}\n"
        "AuthType=auth/none\n"
        "NodeName=node1 NodeAddr=127.0.0.1\n"
        "PartitionName=gpu Nodes=node1\n"
    )
    return {"SLURM_CONF": str(conf)}


UNQUOTED = """\
job:
  name: gpt
  command: python train.py
  nodes: 4:8
  procs_per_node: 8
scheduler:
  backend: slurm
  options: {spares: 1, partition: gpu, time: 1:30:00}
"""


def test_a_dry_run_and_validate_ask_no_slurm_controller(tmp_path: Path) -> None:
    """``nodes: 4:8`` unquoted is 4 to 8 nodes (8 and a spare asked for), ``time: 1:30:00``
    stays the text; and a named partition is not looked up, so no controller is needed."""
    env = _no_controller(tmp_path)
    config = tmp_path / "job.yaml"
    config.write_text(UNQUOTED)
    done = run_planaria(tmp_path, "submit", "--dry-run", str(config), env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    for line in [
        "#SBATCH --nodes=9",  # 8 at most, 1 spare
        "#SBATCH --partition=gpu",
        "#SBATCH --time=1:30:00",
        "# Written by planaria submit: job gpt, 4-8 node(s) of 8 worker(s), 0 standing by, "
        "1 spare(s).",
    ]:
        assert line + "\n" in done.stdout, f"{line!r} missing from:\n{done.stdout}"

    overridden = run_planaria(
        tmp_path, "submit", "--dry-run", str(config), "--set", "job.nodes=2:3", env=env
    )
    assert overridden.returncode == 0, overridden.stderr
    assert "#SBATCH --nodes=4\n" in overridden.stdout
    assert "job gpt, 2-3 node(s)" in overridden.stdout
    standing = run_planaria(
        tmp_path, "submit", "--dry-run", str(config), "--set", "job.standby=2", env=env
    )
    assert standing.returncode == 0, standing.stderr
    assert "#SBATCH --nodes=11\n" in standing.stdout  # 8, 2 standing by, 1 spare
    assert "8 worker(s), 2 standing by, 1 spare(s)." in standing.stdout

    valid = run_planaria(tmp_path, "config", "validate", str(config), env=env, timeout=60)
    assert valid.returncode == 0, valid.stderr
    assert "valid (job 'gpt'" in valid.stdout


def test_an_option_that_is_not_one_word_is_refused(tmp_path: Path) -> None:
    config = job(tmp_path, {"backend": "slurm", "options": {"partition": "debug; rm -rf ~"}})
    done = run_planaria(tmp_path, "submit", "--dry-run", str(config))
    assert done.returncode == 2
    assert "scheduler.options.partition" in done.stderr


@pytest.mark.usefixtures("slurm_cluster")
def test_run_outside_an_allocation_is_a_clear_error(tmp_path: Path) -> None:
    config = job(tmp_path, {"backend": "slurm"})
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_JOB")}
    env["SLURM_JOB_ID"] = ""
    done = run_planaria(tmp_path, "run", str(config), env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "not inside a Slurm allocation" in done.stderr
    assert "planaria submit" in done.stderr


@pytest.mark.usefixtures("slurm_cluster")
def test_an_unknown_partition_is_a_config_error(tmp_path: Path) -> None:
    config = job(tmp_path, {"backend": "slurm", "options": {"partition": "nosuch"}})
    done = run_planaria(tmp_path, "submit", str(config))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "scheduler.options.partition" in done.stderr
    assert "no partition 'nosuch'" in done.stderr


@pytest.mark.usefixtures("slurm_cluster")
def test_a_refused_sbatch_is_an_error_with_slurm_s_message(tmp_path: Path) -> None:
    # 3 nodes and a spare are all 4 of the cluster's; one remembered bad leaves too few.
    config = job(tmp_path, {"backend": "slurm", "options": {"spares": 1}}, nodes=3)
    (tmp_path / ".planaria").mkdir()
    (tmp_path / ".planaria" / "slurm-bad-nodes").write_text("node2 lost\n")
    done = run_planaria(tmp_path, "submit", str(config))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "sbatch" in done.stderr
    assert "Requested node configuration is not available" in done.stderr
    assert slurm("squeue", "-h", "-n", "slurm-e2e").stdout == ""


def test_a_scheduler_that_starts_its_own_nodes_cannot_submit(tmp_path: Path) -> None:
    done = run_planaria(tmp_path, "submit", "--dry-run", str(job(tmp_path)))
    assert done.returncode == 2
    assert "scheduler 'local' starts its nodes itself: use `planaria run`" in done.stderr


def _visible(secret: str) -> list[str]:
    seen = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if secret.encode() in (entry / "cmdline").read_bytes():
                    seen.append(entry.name)
            except OSError:
                continue
    return seen


def test_the_token_shows_in_no_command_line_and_not_in_slurm(allocation: str) -> None:
    secret = secrets.token_urlsafe(32)
    scheduler = SlurmScheduler(SlurmOptions(job_id=allocation, stop_grace=0.5))
    spec = LaunchSpec(
        job="token",
        command=(sys.executable, "-c", "import time; time.sleep(600)"),
        env={"PLANARIA_TOKEN": secret},
    )
    try:
        handles = scheduler.launch(spec, 2)
        running: set[str] = set()

        def all_running() -> bool:
            running.update(e.node_id for e in scheduler.poll(0.5) if e.state is NodeState.RUNNING)
            return running == {h.node_id for h in handles}

        wait_for("the steps to run", all_running, timeout=60, every=0)
        steps = [
            line.split("|")[0]
            for line in slurm("squeue", "-h", "-s", "-j", allocation, "-o", "%i|%j").stdout.split()
            if "|planaria." in line
        ]
        assert len(steps) == 2
        shown = slurm("scontrol", "-dd", "show", "job", allocation).stdout
        for step in steps:
            shown += slurm("scontrol", "-dd", "show", "step", step).stdout
        assert steps[0] in shown
        assert secret not in shown
        assert _visible(secret) == []
        # It does reach the agents, through their environment.
        found = processes_with({f"PLANARIA_TOKEN={secret}".encode()})
        assert found
    finally:
        scheduler.stop()
