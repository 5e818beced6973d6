"""From the validated config to what agents watch (:class:`DiagnosisSpec`) and what the
master decides with (:class:`DiagnosisPolicy`)."""

from __future__ import annotations

from planaria.config.resolve import ResolvedConfig
from planaria.diagnosis.classify import Classifier
from planaria.diagnosis.messages import CheckSpec, DiagnosisSpec
from planaria.diagnosis.policy import DiagnosisPolicy
from planaria.plugin.manager import PluginManager


def agent_spec(resolved: ResolvedConfig) -> DiagnosisSpec:
    section = resolved.config.diagnosis
    return DiagnosisSpec(
        hang_timeout=section.hang_timeout,
        first_step_timeout=section.first_step_timeout,
        straggler_window=section.straggler_window,
        checks=[
            CheckSpec(
                name=c.name,
                backend=c.record.name,
                options=c.options.model_dump(mode="json"),
                timeout=c.timeout,
            )
            for c in resolved.checks
        ],
        disable_plugins=list(resolved.config.plugins.disable),
    )


def master_policy(resolved: ResolvedConfig, manager: PluginManager) -> DiagnosisPolicy:
    section = resolved.config.diagnosis
    return DiagnosisPolicy(
        classifier=Classifier(section.fault_patterns, manager.fault_patterns()),
        straggler_factor=section.straggler_factor,
        replace_stragglers=section.replace_stragglers,
        on_user_error=section.on_user_error,
    )
