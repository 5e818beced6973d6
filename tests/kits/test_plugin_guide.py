"""The conformance-kit examples of docs/writing-a-plugin.md run as shown and pass.

A ``python`` block right after ``<!-- test: NAME.py -->`` is written to ``NAME.py`` and run by
pytest in a child process; one after ``<!-- the file PATH -->`` must be that file of the
repository, whole (its own tests run it).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from support.pytest_runs import run_pytest

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "writing-a-plugin.md"
LOADAVG = ROOT / "examples" / "outside-plugin" / "src"
BLOCK = re.compile(r"<!-- (test: |the file )(\S+) -->\n```python\n(.*?)```", re.DOTALL)


def blocks(kind: str) -> dict[str, str]:
    return {name: code for marker, name, code in BLOCK.findall(GUIDE.read_text()) if marker == kind}


def test_the_guide_quotes_the_example_s_tests_whole() -> None:
    quoted = blocks("the file ")
    assert quoted, "the guide quotes no file"
    for path, code in quoted.items():
        assert code == (ROOT / path).read_text(), f"the guide's copy of {path} is out of date"


@pytest.mark.slow
def test_every_kit_example_passes(tmp_path: Path) -> None:
    examples = blocks("test: ")
    assert set(examples) == {
        "test_kit_scheduler.py",
        "test_kit_node_benchmark.py",
        "test_kit_fault_patterns.py",
        "test_kit_rendezvous.py",
        "test_kit_storage.py",
        "test_loadavg_in_process.py",
    }
    for name, code in examples.items():
        (tmp_path / name).write_text(code)
    env = {k: v for k, v in os.environ.items() if k != "PLANARIA_DISABLE_PLUGINS"}
    # The in-process example imports the example plugin's module; nothing installs it.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(LOADAVG), env.get("PYTHONPATH")]))
    run = run_pytest(tmp_path, env, tmp_path, "-q")
    assert run.returncode == 0, run.output
    assert not run.named("skipped"), run.messages
    assert len([t for t in run.named("passed") if t.startswith("test_loadavg_in_process")]) == 3
    classes = {test.split("::")[0] for test in run.named("passed")}
    assert {
        "TestLocalScheduler",
        "TestCpuBenchmark",
        "TestMyChipPatterns",
        "TestTopologyByRack",
        "TestLocalStorage",
    } <= classes, run.output
