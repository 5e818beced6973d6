"""The job's token stays with the master and the agents: workers, the warm interpreter they are
forked from and the checkpoint persister never talk to the master, so none of them has it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from planaria.testing.jobs import events, job, run

PROBE = """
import json, os, sys, time
from pathlib import Path

def environ(pid):
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    return dict(e.split("=", 1) for e in raw.decode(errors="replace").split("\\0") if "=" in e)

others = {}
deadline = time.time() + 10
while time.time() < deadline and not any("persister" in k for k in others):
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if b"planaria.checkpoint.persister" in cmd:
                others[f"persister {entry.name}"] = environ(entry.name)
    time.sleep(0.1)
others[f"parent {os.getppid()}"] = environ(os.getppid())
rank = os.environ["RANK"]
Path(f"env-{rank}.json").write_text(json.dumps({"self": dict(os.environ), **others}))
"""


def test_no_worker_persister_or_zygote_gets_the_token(tmp_path, mark):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    config = job(
        tmp_path,
        job={"command": [sys.executable, str(probe)], "nodes": 1, "procs_per_node": 2},
        checkpoint={"keep_last": 1},
    )
    result = run(tmp_path, mark, str(config))
    assert result.returncode == 0, result.stdout + result.stderr
    seen = 0
    for rank in (0, 1):
        found = json.loads(Path(tmp_path / f"env-{rank}.json").read_text())
        assert any(k.startswith("persister") for k in found), found.keys()
        for who, env in found.items():
            assert env is not None, who
            seen += 1
            assert "PLANARIA_TOKEN" not in env, f"{who} has the job's token"
        assert found["self"]["RANK"] == str(rank)
    assert seen >= 6
    assert [e for e in events(tmp_path) if e["kind"] == "job_finished"]
