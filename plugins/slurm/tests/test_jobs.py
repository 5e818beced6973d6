"""``planaria submit`` and ``planaria run`` on a real Slurm cluster, end to end: a training job
(examples/train_gpt.py over gloo) submitted with sbatch on 2 nodes and a spare loses a node to
``scontrol ... state=down`` (to ``scancel`` of its step: test_multihost.py), is replaced on the
spare and ends with bitwise the weights of a run without a fault; with a node standing by
(``job.standby``), the node set down has its place taken by that one at once, and the spare
refills the pool; with no spare left, the job is requeued without the bad node."""

from __future__ import annotations

import json
import sys
import time

import pytest
from conftest import EXAMPLE, job, slurm
from slurm_jobs import finish, job_state, steps, submit_and_pause

from planaria.testing.jobs import (
    final_weights,
    job_events,
    restored_from_replicas,
    run_planaria,
    standby_took_over,
    wait_for,
)

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.usefixtures("slurm_cluster")


@pytest.fixture
def resume_nodes(slurm_cluster):
    """Nodes a test set down: resumed afterwards. Slurm SIGKILLs the step of a node it takes
    down, so what its agent had in /dev/shm stays there until the node reboots; here, where
    every node is this machine, a cleanup job removes it (as an operator would on a node
    back in service)."""
    downed: list[tuple[str, list[str]]] = []
    yield downed
    for node, _ in downed:
        slurm("scontrol", "update", f"nodename={node}", "state=resume", check=False)
    for node, leftovers in downed:
        wait_for(
            f"{node} back",
            lambda n=node: slurm("sinfo", "-h", "-n", n, "-o", "%T").stdout.strip() == "idle",
            timeout=30,
        )
        if leftovers:
            cleanup = [sys.executable, "-m", "planaria_slurm.cleanup", *leftovers]
            slurm("srun", "-N1", f"--nodelist={node}", "--oversubscribe", *cleanup)


def test_a_node_set_down_is_replaced_and_excluded(tmp_path, clean_weights, resume_nodes):
    job_id, agents = submit_and_pause(tmp_path)
    victim = next(name for name in agents if name.endswith(".node-1"))
    _, host = agents[victim]
    batch_host = slurm("squeue", "-h", "-j", job_id, "-o", "%B").stdout.strip()
    assert host != batch_host  # the master runs on the batch host: that one must live
    leftovers: list[str] = []
    resume_nodes.append((host, leftovers))
    downed = time.monotonic()
    slurm("scontrol", "update", f"nodename={host}", "state=down", "reason=planaria test")

    def replaced() -> dict | None:
        return next((e for e in job_events(tmp_path) if e["kind"] == "node_replaced"), None)

    event = wait_for("the replacement", replaced)
    took = time.monotonic() - downed
    assert not event["message"].endswith(f"on {host}"), event
    lost = [
        e["message"] for e in job_events(tmp_path) if f"Slurm node {host} is down" in e["message"]
    ]
    assert lost, "the node's loss names Slurm's state"
    output = finish(tmp_path, job_id)
    assert "succeeded" in output, output
    print(f"state=down -> node_replaced in {took:.1f}s")
    (run_dir,) = tmp_path.glob("planaria-runs/*")
    leftovers += [run_dir.name, "node-1"]
    bad = (tmp_path / ".planaria" / "slurm-bad-nodes").read_text()
    assert bad.split()[0] == host, bad
    # A later submission of the job keeps off the bad node.
    dry = run_planaria(tmp_path, "submit", "--dry-run", str(tmp_path / "job.yaml"))
    assert f"#SBATCH --exclude={host}\n" in dry.stdout, dry.stdout
    final = final_weights(tmp_path)
    assert all(torch.equal(final[k], clean_weights[k]) for k in final)


def test_a_node_standing_by_takes_the_place_of_a_node_set_down(
    tmp_path, clean_weights, resume_nodes
):
    """2 nodes, 1 standing by and a spare: 4, the whole cluster. A node of the running world
    (not the batch host's, where the master runs) is set down; the round after it has the node
    that stood by, in the lost node's rank, and the replacement on the spare refills the
    pool."""
    job_id, agents = submit_and_pause(tmp_path, standby=1, checkpoint={"replica": {}})
    assert len(agents) == 3, agents  # 2 in the world, 1 standing by; the spare holds none
    host_of = {name.rsplit(".", 1)[1]: host for name, (_, host) in agents.items()}
    rounds = [e for e in job_events(tmp_path) if e["kind"] == "rendezvous_completed"]
    world = rounds[0]["data"]["ranks"]
    (spare,) = set(host_of) - set(world)
    batch_host = slurm("squeue", "-h", "-j", job_id, "-o", "%B").stdout.strip()
    victim = next(n for n in sorted(world) if host_of[n] != batch_host)
    host = host_of[victim]
    leftovers: list[str] = []
    resume_nodes.append((host, leftovers))
    slurm("scontrol", "update", f"nodename={host}", "state=down", "reason=planaria test")
    output = finish(tmp_path, job_id)
    assert "succeeded" in output, output
    (run_dir,) = tmp_path.glob("planaria-runs/*")
    leftovers += [run_dir.name, victim]

    replaced = standby_took_over(job_events(tmp_path), victim, spare)
    restored_from_replicas(job_events(tmp_path), victim)
    # The spare's node replaced the lost one and stood by in its turn.
    assert replaced["data"]["replacement"] not in host_of
    assert replaced["data"]["replacement_host"] not in host_of.values()
    final = final_weights(tmp_path)
    assert final.keys() == clean_weights.keys()
    assert all(torch.equal(final[k], clean_weights[k]) for k in final)


def test_with_no_spare_left_the_job_is_requeued_without_the_bad_node(tmp_path, resume_nodes):
    """2 nodes, no spare, requeue: a node set down cannot be replaced, so the batch job is
    requeued without it; the new run resumes from the committed checkpoint (an absolute
    storage path) and ends with the weights of a run without a fault. A chaos pause would
    pause the requeued run too: the job is long enough instead (120 steps) for the fault to
    land after its first checkpoint."""
    longer = [
        sys.executable,
        str(EXAMPLE),
        "--steps",
        "120",
        "--ckpt-every",
        "4",
        "--out",
        "final.pt",
    ]
    clean_dir = tmp_path / "clean"
    clean_dir.mkdir()
    clean = run_planaria(clean_dir, "run", str(job(clean_dir, command=longer)))
    assert clean.returncode == 0, clean.stdout + clean.stderr
    where = tmp_path / "requeued"
    where.mkdir()
    options = {"requeue": True, "sbatch": ["--oversubscribe"]}
    config = job(where, {"backend": "slurm", "options": options}, command=longer)
    storage = {"storage": {"options": {"path": str(where / "ckpt")}}}
    submitted = run_planaria(
        where, "submit", str(config), "--set", f"checkpoint={json.dumps(storage)}"
    )
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    job_id = submitted.stdout.split()[-1]
    wait_for("the job's start", lambda: job_state(job_id) == "RUNNING")
    wait_for(
        "a committed checkpoint",
        lambda: any(e["kind"] == "checkpoint_committed" for e in job_events(where)),
        every=0.05,
    )
    agents = steps(job_id)
    victim = next(name for name in agents if name.endswith(".node-1"))
    _, host = agents[victim]
    leftovers: list[str] = []
    resume_nodes.append((host, leftovers))
    slurm("scontrol", "update", f"nodename={host}", "state=down", "reason=planaria test")
    wait_for("a second run", lambda: len(list(where.glob("planaria-runs/*"))) == 2, timeout=90)
    output = finish(where, job_id)
    assert "succeeded" in output, output
    first = sorted(where.glob("planaria-runs/*"))[0]
    leftovers += [first.name, "node-1"]
    shown = slurm("scontrol", "show", "job", job_id).stdout
    assert "Restarts=1" in shown, shown
    assert f"ExcNodeList={host}" in shown, shown
    second = sorted(where.glob("planaria-runs/*"))[1]
    timeline = [json.loads(x) for x in (second / "events.jsonl").read_text().splitlines()]
    rounds = [e for e in timeline if e["kind"] == "rendezvous_completed"]
    assert rounds[0]["data"]["restore"] == "storage", rounds[0]
    final, reference = final_weights(where), final_weights(clean_dir)
    assert all(torch.equal(final[k], reference[k]) for k in final)
