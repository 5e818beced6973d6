"""From the validated config to what agents watch (:class:`DiagnosisSpec`) and what the
master decides with (:class:`DiagnosisPolicy`)."""

from __future__ import annotations

from planaria.config.resolve import ResolvedConfig
from planaria.diagnosis.classify import Classifier
from planaria.diagnosis.messages import BenchmarkSpec, CheckSpec, DiagnosisSpec
from planaria.diagnosis.policy import DiagnosisPolicy, PreflightPolicy
from planaria.plugin.manager import PluginManager

BENCHMARK_PATH = "diagnosis.preflight_benchmark"


def agent_spec(resolved: ResolvedConfig, preflight_only: bool = False) -> DiagnosisSpec:
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
        preflight=preflight_policy(resolved, preflight_only).enabled,
    )


def preflight_policy(resolved: ResolvedConfig, only: bool = False) -> PreflightPolicy:
    """The pre-flight settings; ``only``: the check alone (``planaria check --preflight``)."""
    section = resolved.config.diagnosis
    bench = resolved.backends.get(BENCHMARK_PATH)
    spec = None
    if bench is not None:
        spec = BenchmarkSpec(
            backend=bench.record.name,
            options=bench.options.model_dump(mode="json"),
            timeout=section.preflight_timeout,
            disable_plugins=list(resolved.config.plugins.disable),
        )
    replace = section.preflight_replace_stragglers
    return PreflightPolicy(
        enabled=(section.preflight or only) and spec is not None,
        benchmark=spec,
        factor=section.preflight_factor or section.straggler_factor,
        replace_stragglers=section.replace_stragglers if replace is None else replace,
        only=only,
    )


def master_policy(
    resolved: ResolvedConfig, manager: PluginManager, preflight_only: bool = False
) -> DiagnosisPolicy:
    section = resolved.config.diagnosis
    return DiagnosisPolicy(
        classifier=Classifier(section.fault_patterns, manager.fault_patterns()),
        straggler_factor=section.straggler_factor,
        replace_stragglers=section.replace_stragglers,
        on_user_error=section.on_user_error,
        crash_loop_rounds=section.crash_loop_rounds,
        preflight=preflight_policy(resolved, preflight_only),
    )
