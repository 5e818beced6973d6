"""``planaria run`` on the session's Ray cluster, end to end: examples/train_gpt.py over gloo
on 2 Ray nodes of 3. A Ray node whose raylet is killed from outside loses its agent; the
master replaces it on the free Ray node and the job ends with bitwise the weights of a run
without a fault; with a node standing by (``job.standby``), that node takes the lost one's
place at once, and the replacement refills the pool. A killed worker restarts in place and
restores from memory. With ``rendezvous.backend: topology`` the nodes on Ray nodes of one
switch (a Ray node label) get contiguous ranks (first here: it needs the cluster's first three
raylets, on two switches)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ray_jobs import finished, job, on_ray, paused_run

from planaria.testing import jobs
from planaria.testing.jobs import (
    final_weights,
    job_events,
    restored_from_replicas,
    run_planaria,
    standby_took_over,
    switches_by_rank,
    wait_for,
    with_sections,
)
from planaria_ray.testing import LocalCluster

torch = pytest.importorskip("torch")
ray = pytest.importorskip("ray")


def test_the_nodes_of_one_switch_get_contiguous_ranks(
    tmp_path: Path, ray_cluster: LocalCluster
) -> None:
    """3 nodes, one on each worker raylet: two of them are on one switch, the third on the
    other (their Ray node labels). Whatever order the agents join in, the two take ranks 0
    and 1 or 1 and 2, and the job trains to its end."""
    switches = sorted(n.labels.get("switch", "") for n in ray_cluster.worker_nodes())
    assert switches in (["s1", "s1", "s2"], ["s1", "s2", "s2"]), (
        f"the live raylets must be on two switches, two on one: {switches} (a test before "
        "this one changed the cluster)"
    )
    config = with_sections(
        job(tmp_path, on_ray(ray_cluster.address), nodes=3), rendezvous={"backend": "topology"}
    )
    run = subprocess.Popen(
        [sys.executable, "-m", "planaria", "run", str(config)],
        cwd=tmp_path,
        env={**os.environ, "COLUMNS": "200"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:

        def formed() -> dict | None:
            rounds = [e for e in job_events(tmp_path) if e["kind"] == "rendezvous_completed"]
            return rounds[0]["data"]["ranks"] if rounds else None

        ranks = wait_for("the first round", formed, timeout=180)
        (run_dir,) = tmp_path.glob("planaria-runs/*")
        ray_node = {n: ray_cluster.ray_node_of(run_dir, n) for n in ranks}
        output = finished(run)
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate(timeout=60)
    assert run.returncode == 0, output

    def switch(node: str) -> str:
        return ray_cluster.node_by_id(ray_node[node]).labels["switch"]

    assert switches_by_rank(job_events(tmp_path), switch) == switches, (ranks, ray_node)


def test_a_ray_node_whose_raylet_is_killed_is_replaced_on_the_free_node(
    tmp_path: Path, ray_cluster: LocalCluster, clean_weights: dict
) -> None:
    """Rank 0 stops itself at step 10, so that the loss lands mid-training; node-1's raylet
    is then SIGKILLed. Its actor, agent and worker die with it; the master replaces node-1 on
    the third Ray node, and the job resumes from the last checkpoint."""
    config = job(tmp_path, on_ray(ray_cluster.address))
    with paused_run(tmp_path, config, ray_cluster) as run:
        (run_dir,) = tmp_path.glob("planaria-runs/*")
        used = {ray_cluster.ray_node_of(run_dir, n) for n in ("node-0", "node-1")}
        victim = ray_cluster.ray_node_of(run_dir, "node-1")
        free = {str(n.node_id) for n in ray_cluster.worker_nodes()} - used
        assert len(free) == 1, (free, used)
        killed = time.monotonic()
        ray_cluster.kill_raylet(victim)

        def replaced() -> dict | None:
            return next((e for e in job_events(tmp_path) if e["kind"] == "node_replaced"), None)

        event = wait_for("the replacement", replaced)
        took = time.monotonic() - killed
        output = finished(run)
    assert run.returncode == 0, output
    print(f"raylet killed -> node_replaced in {took:.1f}s")
    data = event["data"]
    assert data["host"] == victim, event
    assert data["replacement_host"] == free.pop(), event  # the free node, not the lost one
    lost = [
        e
        for e in job_events(tmp_path)
        if e["kind"] == "fault_detected" and e["data"].get("fault") == "node_lost"
    ]
    assert lost, [e["kind"] for e in job_events(tmp_path)]
    restored = [e for e in job_events(tmp_path) if e["kind"] == "rendezvous_completed"]
    assert restored[-1]["data"]["restore"] == "storage", restored[-1]
    final = final_weights(tmp_path)
    assert final.keys() == clean_weights.keys()
    assert all(torch.equal(final[k], clean_weights[k]) for k in final)


def test_a_ray_node_standing_by_takes_the_place_of_one_whose_raylet_is_killed(
    tmp_path: Path, ray_cluster: LocalCluster, clean_weights: dict
) -> None:
    """2 nodes and 1 standing by: an actor on each of the 3 Ray nodes. A fourth Ray node joins
    for the replacement, and the raylet of the Ray node of rank 1 is SIGKILLed (the cluster
    keeps its size for the tests after this one); the round after the loss has the node that
    stood by in rank 1, and the replacement stands by in its turn."""
    config = job(tmp_path, on_ray(ray_cluster.address), standby=1)
    with_sections(config, checkpoint={"replica": {}})
    with jobs.paused_run(tmp_path, config) as run:
        (run_dir,) = tmp_path.glob("planaria-runs/*")
        (started,) = [e for e in job_events(tmp_path) if e["kind"] == "job_started"]
        nodes = started["data"]["nodes"]
        assert len(nodes) == 3, nodes  # 2 in the world, 1 standing by
        first = next(e for e in job_events(tmp_path) if e["kind"] == "rendezvous_completed")
        world = first["data"]["ranks"]
        (spare,) = set(nodes) - set(world)
        lost = next(n for n, rank in world.items() if rank == 1)
        victim = ray_cluster.ray_node_of(run_dir, lost)
        added = ray_cluster.add_node()
        ray_cluster.kill_raylet(victim)
        output = finished(run)
    assert run.returncode == 0, output
    replaced = standby_took_over(job_events(tmp_path), lost, spare)
    assert replaced["data"]["replacement_host"] == added, replaced
    restored_from_replicas(job_events(tmp_path), lost)
    final = final_weights(tmp_path)
    assert final.keys() == clean_weights.keys()
    assert all(torch.equal(final[k], clean_weights[k]) for k in final)


def test_a_killed_worker_restarts_in_place_and_restores_from_memory(
    tmp_path: Path, ray_address: str, clean_weights: dict
) -> None:
    config = job(tmp_path, on_ray(ray_address))
    chaos = ["--set", 'chaos=[{"kind": "kill_worker", "rank": 1, "at_step": 10}]']
    done = run_planaria(tmp_path, "run", str(config), *chaos)
    assert done.returncode == 0, done.stdout + done.stderr
    kinds = [e["kind"] for e in job_events(tmp_path)]
    assert "node_replaced" not in kinds, kinds
    timeline = job_events(tmp_path)
    (kill,) = [
        i
        for i, e in enumerate(timeline)
        if e["kind"] == "fault_detected" and e["data"].get("signal") == 9 and e["rank"] == 1
    ]
    # The round after the kill restored the newest step every rank held in memory. (A round
    # before it may have failed on its own: a port the rendezvous chose, taken meanwhile by
    # one of Ray's processes, is a worker failure the master restarts like any.)
    after = next(e for e in timeline[kill:] if e["kind"] == "rendezvous_completed")
    assert after["data"]["restore"].startswith("memory:"), after
    final = final_weights(tmp_path)
    assert all(torch.equal(final[k], clean_weights[k]) for k in final)


def test_resources_no_ray_node_has_are_refused_at_once(tmp_path: Path, ray_address: str) -> None:
    config = job(tmp_path, on_ray(ray_address, resources={"NPU": 8}))
    started = time.monotonic()
    done = run_planaria(tmp_path, "run", str(config), timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert time.monotonic() - started < 30
    assert "scheduler.options" in done.stderr + done.stdout
    assert "'NPU': 8" in done.stderr + done.stdout, done.stderr


def test_an_unreachable_cluster_is_refused_at_once(tmp_path: Path) -> None:
    config = job(tmp_path, on_ray("127.0.0.1:1"))
    started = time.monotonic()
    done = run_planaria(tmp_path, "run", str(config), timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert time.monotonic() - started < 30
    assert "cannot reach the Ray cluster at 127.0.0.1:1" in done.stderr + done.stdout
