"""Health checks in the loop: an agent runs the job's checks before every round it joins.

The checks and their options come from the master (validated there against the same plugins);
the agent binds them to its own installed plugins, so a plugin or a script missing on this node
is this node's failure, reported like a failed device.
"""

from __future__ import annotations

from pathlib import Path

from planaria.diagnosis.messages import CheckFailure, CheckSpec, DiagnosisSpec
from planaria.errors import PluginError
from planaria.health.api import CheckContext, HealthCheckRecord, NodeHealth
from planaria.health.runner import ConfiguredCheck, run_checks
from planaria.plugin.manager import PluginManager
from planaria.plugin.records import PluginKind


def bind_checks(
    specs: list[CheckSpec], manager: PluginManager
) -> tuple[list[ConfiguredCheck], list[CheckFailure]]:
    """The checks this node can run, and a failure for each it cannot."""
    checks, failures = [], []
    for index, spec in enumerate(specs):
        try:
            record, options = manager.bind(
                PluginKind.HEALTH_CHECK,
                {"backend": spec.backend, "options": spec.options},
                path=f"diagnosis.checks.{index}",
            )
        except PluginError as exc:
            detail = f"cannot run on this node: {exc}"
            failures.append(CheckFailure(check=spec.name, status="error", detail=detail))
            continue
        assert isinstance(record, HealthCheckRecord)
        checks.append(ConfiguredCheck(spec.name, record, options, spec.timeout))
    return checks, failures


def failures_of(health: NodeHealth) -> list[CheckFailure]:
    found = []
    for result in health.checks:
        if result.status.healthy:
            continue
        bad = [
            f"{d.device}: {d.status.value} {d.detail}".strip()
            for d in result.devices
            if not d.status.healthy
        ]
        detail = result.error or "; ".join(bad) or f"status {result.status.value}"
        found.append(CheckFailure(check=result.check, status=result.status.value, detail=detail))
    return found


def check_node(spec: DiagnosisSpec, node: str, workdir: Path) -> list[CheckFailure]:
    """Run the job's checks here (blocking: call it in a thread). Empty: healthy."""
    if not spec.checks:
        return []
    manager = PluginManager.from_entry_points(disable=spec.disable_plugins)
    checks, failures = bind_checks(spec.checks, manager)
    health = run_checks(checks, CheckContext(node=node, workdir=workdir))
    return failures + failures_of(health)
