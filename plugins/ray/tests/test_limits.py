"""What ``planaria run`` does where Ray cannot help: Ray not importable (a config error naming
the package, exit 2, before anything starts), and a lost Ray node with no free node to put its
replacement on (an elastic job goes on with the nodes it has)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from ray_jobs import finished, job, on_ray, paused_run

from planaria.testing.jobs import job_events, wait_for
from planaria_ray.testing import LocalCluster

pytest.importorskip("torch")


def test_without_ray_the_run_is_refused_naming_the_package(tmp_path: Path) -> None:
    """A ``ray`` package first on the path that cannot be imported, as where Ray is missing
    (or broken): the plugin itself still loads, and says what to install."""
    hidden = tmp_path / "hidden" / "ray"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError(\"No module named 'ray'\")\n")
    path = os.pathsep.join(p for p in (str(hidden.parent), os.environ.get("PYTHONPATH")) if p)
    config = job(tmp_path, on_ray("127.0.0.1:6379"))
    done = subprocess.run(
        [sys.executable, "-m", "planaria", "run", str(config)],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": path, "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    said = done.stdout + done.stderr
    assert done.returncode == 2, said
    assert "scheduler.backend" in said, said
    assert "pip install 'ray>=2.10'" in said, said
    assert not list(tmp_path.glob("planaria-runs/*/logs/*.log")), "nothing may have started"


def test_a_lost_node_with_no_free_ray_node_shrinks_an_elastic_job(
    tmp_path: Path, ray_cluster: LocalCluster
) -> None:
    """``nodes: 2:3`` takes all three agent raylets; one of them (not rank 0's) is killed while
    rank 0 pauses at step 10. No Ray node is left for a replacement: the job goes on with two
    and ends well."""
    config = job(tmp_path, on_ray(ray_cluster.address), nodes="2:3")
    with paused_run(tmp_path, config, ray_cluster) as run:
        (round_,) = [e for e in job_events(tmp_path) if e["kind"] == "rendezvous_completed"][-1:]
        ranks = round_["data"]["ranks"]
        assert len(ranks) == 3, round_
        victim_node = next(n for n, rank in ranks.items() if rank != 0)
        (run_dir,) = tmp_path.glob("planaria-runs/*")
        ray_cluster.kill_raylet(ray_cluster.ray_node_of(run_dir, victim_node))

        def failed() -> dict | None:
            found = (e for e in job_events(tmp_path) if e["kind"] == "node_replacement_failed")
            return next(found, None)

        event = wait_for("the replacement's failure", failed)
        output = finished(run)
    assert run.returncode == 0, output
    # No replacement went to the killed raylet's node while the GCS still listed it alive.
    assert "node=node-3" not in output, output
    assert event["data"]["nodes_left"] == 2, event
    assert "no free Ray node" in event["data"]["error"], event
    last = [e for e in job_events(tmp_path) if e["kind"] == "rendezvous_completed"][-1]
    assert last["data"]["world_size"] == 2, last
