"""The leak checks every test suite here loads (:mod:`planaria.testing.leaks`): a test that
leaves its own files in /dev/shm fails; files of other planaria jobs on the machine, made before
or while the test runs, fail nothing.

The checks run in a pytest of their own (as a plugin author's suite would run them), on tests
that create real node directories through :mod:`planaria.shm`.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from planaria.shm import SHM_DIR, TAG_ENV, make_private_dir, name_prefix, node_dir, remove_dir
from support.pytest_runs import run_pytest

SUITE = """
import os
from pathlib import Path

from planaria.shm import make_private_dir, node_dir, remove_dir

MADE = Path(os.environ["MADE"])


def made(path):
    with MADE.open("a") as f:
        f.write(f"{path}\\n")
    return path


def test_leaves_its_node_directory():
    made(make_private_dir(node_dir("leak", "node-0")))


def test_cleans_up():
    remove_dir(made(make_private_dir(node_dir("clean", "node-0"))))


def test_another_job_creates_files_meanwhile(monkeypatch):
    with monkeypatch.context() as other:  # another job: another tag, or none
        other.setenv("PLANARIA_SHM_TAG", "otherjob")
        made(make_private_dir(node_dir("other", "node-0")))
        other.delenv("PLANARIA_SHM_TAG")
        made(make_private_dir(node_dir("untagged", "node-0")))
"""


def test_a_test_fails_on_its_own_leftovers_and_only_on_them(tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text('pytest_plugins = ["planaria.testing.leaks"]\n')
    (suite / "test_shm.py").write_text(textwrap.dedent(SUITE))
    made = tmp_path / "made"
    before = make_private_dir(SHM_DIR / f"planaria-earlier-{os.getpid()}-node-0")  # another job's
    env = {k: v for k, v in os.environ.items() if k != TAG_ENV}
    env["MADE"] = str(made)
    try:
        result = run_pytest(suite, env, tmp_path)
    finally:
        remove_dir(before)
        paths = [Path(p) for p in made.read_text().split()] if made.exists() else []
        for path in paths:
            remove_dir(path)
    assert result.outcomes == {
        "test_shm::test_leaves_its_node_directory": "error",
        "test_shm::test_cleans_up": "passed",
        "test_shm::test_another_job_creates_files_meanwhile": "passed",
    }, result.output
    leaked = next(p for p in paths if "-leak-" in p.name)
    assert (
        f"left in {SHM_DIR}: ['{leaked.name}']"
        in result.messages["test_shm::test_leaves_its_node_directory"]
    ), result.output
    # Each test had a tag of its own, and every name it made carried it.
    tags = {
        p.name.split("-")[1] for p in paths if "other" not in p.name and "untagged" not in p.name
    }
    assert len(tags) == 2 and all(t.startswith("t") for t in tags), paths


def test_the_tag_is_in_every_name_and_a_bad_one_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(TAG_ENV, "abc123")
    assert name_prefix() == "planaria-abc123-"
    assert node_dir("run", "node-1").name == "planaria-abc123-run-node-1"
    monkeypatch.setenv(TAG_ENV, "../x")
    with pytest.raises(Exception, match=r"PLANARIA_SHM_TAG='\.\./x'.*1 to 16 letters or digits"):
        node_dir("run", "node-1")
