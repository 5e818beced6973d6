"""Health checks in the loop: an agent runs the job's checks before every round it joins.

The checks and their options come from the master (validated there against the same plugins);
the agent binds them to its own installed plugins, so a plugin or a script missing on this node
is this node's failure, reported like a failed device.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from planaria.diagnosis.messages import CheckFailure, CheckSpec, DiagnosisSpec
from planaria.errors import PluginError
from planaria.health.api import CheckContext, NodeHealth
from planaria.health.runner import ConfiguredCheck, run_checks
from planaria.plugin.manager import PluginManager
from planaria.plugin.records import HealthCheckRecord, PluginKind


def bind_checks(
    specs: list[CheckSpec], manager: PluginManager
) -> tuple[list[ConfiguredCheck], list[CheckFailure]]:
    """The checks this node can run, and a failure for each it cannot."""
    checks, failures = [], []
    for spec in specs:
        try:
            record = manager.resolve(PluginKind.HEALTH_CHECK, spec.backend)
            assert isinstance(record, HealthCheckRecord)
            options = record.options.model_validate(spec.options)
        except PluginError as exc:
            failures.append(CheckFailure(check=spec.name, status="error", detail=str(exc)))
            continue
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()
            )
            detail = f"options invalid on this node: {problems}"
            failures.append(CheckFailure(check=spec.name, status="error", detail=detail))
            continue
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
