"""``planaria submit`` and ``planaria run`` on a real Slurm cluster, end to end: a training job
(examples/train_gpt.py over gloo) submitted with sbatch on 2 nodes and a spare loses a node to
``scontrol ... state=down`` (to ``scancel`` of its step: test_multihost.py), is replaced on the
spare and ends with bitwise the weights of a run without a fault; with a node standing by
(``job.standby``), the node set down has its place taken by that one at once, and the spare
refills the pool; with no spare left, the job is requeued without the bad node. With
``rendezvous.backend: topology`` on the cluster's two leaf switches (cluster.sh's topology.conf),
ranks follow the switches, and a replacement takes the lost node's rank on its switch."""

from __future__ import annotations

import json
import sys
import time
from itertools import pairwise

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


# cluster.sh's topology.conf: two leaf switches of two nodes each.
SWITCH = {"node1": "s1", "node2": "s1", "node3": "s2", "node4": "s2"}


def grouped(ranks: dict[str, int], switch_of: dict[str, str]) -> bool:
    """Whether the nodes of each switch hold contiguous node ranks (one run a switch)."""
    order = [switch_of[n] for n in sorted(ranks, key=ranks.__getitem__)]
    runs = [a for a, b in pairwise(order) if a != b] + order[-1:]
    return len(runs) == len(set(runs))


def test_ranks_follow_switches_and_a_replacement_joins_its_switch(tmp_path, resume_nodes):
    """3 nodes and a spare (the whole cluster), ``rendezvous.backend: topology``: each node
    carries its host's leaf switch, from Slurm (``scontrol show topology``), in the round's
    event and in ``planaria status``; the ranks are grouped by switch. The node on the spare's
    switch (not the batch host's) is set down: the replacement goes to the spare, on that
    switch, and takes the lost node's rank; the survivors keep theirs."""
    job_id, agents = submit_and_pause(tmp_path, nodes=3, sets=["rendezvous.backend=topology"])
    host_of = {name.rsplit(".", 1)[1]: host for name, (_, host) in agents.items()}
    assert len(host_of) == 3, agents
    rounds = [e for e in job_events(tmp_path) if e["kind"] == "rendezvous_completed"]
    first = rounds[0]["data"]
    assert first["topology"] == {n: {"switch": SWITCH[host_of[n]]} for n in first["ranks"]}
    switch_of = {n: SWITCH[h] for n, h in host_of.items()}
    assert grouped(first["ranks"], switch_of), (first["ranks"], switch_of)

    (run_dir,) = tmp_path.glob("planaria-runs/*")
    shown = run_planaria(tmp_path, "status", str(run_dir), "--json")
    assert shown.returncode == 0, shown.stdout + shown.stderr
    nodes = json.loads(shown.stdout)["nodes"]
    assert {n["node_id"]: n["topology"] for n in nodes} == {
        n: {"switch": s} for n, s in switch_of.items()
    }
    text = run_planaria(tmp_path, "status", str(run_dir)).stdout
    assert all(
        f"switch={switch_of[n]}" in next(line for line in text.splitlines() if n + " " in line)
        for n in switch_of
    ), text

    allocated = slurm(
        "scontrol",
        "show",
        "hostnames",
        slurm("squeue", "-h", "-j", job_id, "-o", "%N").stdout.strip(),
    ).stdout.split()
    (spare,) = set(allocated) - set(host_of.values())
    batch_host = slurm("squeue", "-h", "-j", job_id, "-o", "%B").stdout.strip()
    victims = [
        n
        for n in sorted(first["ranks"])
        if SWITCH[host_of[n]] == SWITCH[spare] and host_of[n] != batch_host
    ]
    if not victims:
        pytest.fail(f"no node shares spare {spare}'s switch but the batch host's: {host_of}")
    victim = victims[0]
    host = host_of[victim]
    leftovers: list[str] = []
    resume_nodes.append((host, leftovers))
    slurm("scontrol", "update", f"nodename={host}", "state=down", "reason=planaria test")
    output = finish(tmp_path, job_id)
    assert "succeeded" in output, output
    leftovers += [run_dir.name, victim]

    timeline = job_events(tmp_path)
    (replaced,) = [e for e in timeline if e["kind"] == "node_replaced"]
    assert replaced["data"]["replacement_host"] == spare, replaced
    replacement = replaced["data"]["replacement"]
    after = [e for e in timeline if e["kind"] == "rendezvous_completed"][-1]["data"]
    survivors = {n: r for n, r in first["ranks"].items() if n != victim}
    assert {n: after["ranks"][n] for n in survivors} == survivors, after
    assert after["ranks"][replacement] == first["ranks"][victim], after
    assert (
        after["topology"][replacement] == {"switch": SWITCH[spare]} == {"switch": switch_of[victim]}
    )
    assert grouped(after["ranks"], {**switch_of, replacement: SWITCH[spare]}), after
