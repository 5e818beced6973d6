"""Run pytest in a child process and read each test's outcome from its JUnit XML report.

How the tests of the conformance kits prove that a suite passes an installed plugin and fails a
broken one: the suite runs exactly as a plugin author's ``pytest`` would run it.
"""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path


@dataclass
class PytestRun:
    returncode: int
    output: str
    outcomes: dict[str, str]
    """``"TestClass::test_name"`` (parameters included) -> passed, failed, error or skipped."""
    messages: dict[str, str]
    """The failure, error or skip message of each test that has one."""

    def named(self, outcome: str) -> set[str]:
        return {test for test, seen in self.outcomes.items() if seen == outcome}

    def bare(self, outcome: str) -> set[str]:
        """The test names without their class."""
        return {test.rsplit("::", 1)[-1] for test in self.named(outcome)}


def run_pytest(
    target: Path, env: dict[str, str], cwd: Path, *args: str, timeout: float = 600
) -> PytestRun:
    report = cwd / "report.xml"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"--junitxml={report}",
         "-o", "junit_family=xunit2", *args, str(target)],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    if not report.exists():
        raise AssertionError(f"pytest wrote no report (exit {proc.returncode}):\n{output}")
    outcomes: dict[str, str] = {}
    messages: dict[str, str] = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = "failed" if tag == "failure" else tag
                messages[name] = found.get("message", "") or (found.text or "")
        # A test that failed and then errored in teardown counts as failed.
        if outcomes.get(name) != "failed":
            outcomes[name] = outcome
    return PytestRun(proc.returncode, output, outcomes, messages)
