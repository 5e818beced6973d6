"""The conformance suite of health checks (:class:`~planaria.health.api.HealthCheck` plugins).

Every check runs through the real runner (:func:`planaria.health.runner.run_checks`), with its
thread and its timeout, exactly as ``planaria check`` and the agent run it. Subclass
:class:`HealthCheckConformance` in a test module (the class name must start with ``Test``) and
give it:

``record`` (fixture)
    the check's :class:`~planaria.plugin.records.HealthCheckRecord`. Set ``check_name`` instead
    and the suite resolves it among the installed plugins, which also proves that the entry
    point registers it.
``healthy``, ``unhealthy``, ``not_applicable`` (fixtures)
    each returns a :class:`CheckCase`: the options (as a config file gives them) and, where the
    check needs what no config can say (a recorded driver answer), a factory. A fixture can
    arrange the node first (a fake tool on ``PATH`` with ``monkeypatch``). A check that cannot
    produce one of the cases says so with a flag: ``can_be_unhealthy = False`` and so on.
``degraded`` (fixture, with ``can_be_degraded = True``)
    a case in which the check finds the node usable but impaired (a throttled clock, a warm
    chip): the verdict must be ``degraded``, each degraded device saying why, and the node
    still healthy enough to train.
``hanging`` (fixture, with ``can_hang = True``)
    a case in which the check's own :meth:`~planaria.health.api.HealthCheck.run` blocks (a tool
    that never answers); its :meth:`~planaria.health.api.HealthCheck.cancel` must end it.
``undecidable`` (fixture, with ``can_be_undecidable = True``)
    a case in which the check cannot reach a verdict (a tool's output it cannot read): it must
    raise :class:`~planaria.errors.HealthCheckError` with its own message, not crash.

:func:`run_check` runs one case outside the suite, for a plugin's own tests of its verdicts.

Example::

    class TestLoadavg(HealthCheckConformance):
        check_name = "loadavg"
        can_be_not_applicable = False

        @pytest.fixture
        def healthy(self):
            return CheckCase({"max_load_per_cpu": 1000})

        @pytest.fixture
        def unhealthy(self):
            return CheckCase({"max_load_per_cpu": 1e-9, "degraded_load_per_cpu": 1e-9})

Why one module: it is one suite, a plugin's tests subclass it whole, and its tests share its
case fixtures and the wrappers that run a check through the real runner.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, NoReturn

import pytest
from pydantic import ValidationError

from planaria.health.api import (
    CheckContext,
    CheckResult,
    DeviceResult,
    HealthCheck,
    HealthCheckRecord,
    Status,
)
from planaria.health.runner import ConfiguredCheck, run_checks
from planaria.plugin.manager import PluginManager, validate_options
from planaria.plugin.records import PluginKind, normalize_name

AnyCheck = HealthCheck[Any]
CheckFactory = Callable[[Any, CheckContext], AnyCheck]

METRIC_NAME = re.compile(r"^[a-z_][a-z0-9_]*$")
"""Metric names become Prometheus names: lower-case snake case."""

UNKNOWN_KEY = "planaria_conformance_no_such_option"
SUMMARY_CHARS = 200


@dataclass(frozen=True)
class CheckCase:
    """One way to run the check: ``CheckCase({"max_temp": 80}, factory=make_check)``.

    ``options`` are validated by the record's Options model, as a config file's would be.
    ``factory(options, context)`` builds the check where the record's factory alone cannot (a
    check wired to a recorded driver); by default the record's factory builds it.
    """

    options: Mapping[str, Any] = field(default_factory=dict)
    factory: CheckFactory | None = None


@dataclass
class _Probe:
    """What the suite saw of one check instance that it wrapped."""

    cancelled: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)
    released_by_cancel: bool = False


def _wrapped(
    record: HealthCheckRecord,
    case: CheckCase,
    probe: _Probe,
    behaviour: Callable[[AnyCheck, _Probe], list[DeviceResult]] | None = None,
) -> HealthCheckRecord:
    """A record whose check builds the plugin's own check and delegates to it, so that the
    suite sees when :meth:`run` ends and when :meth:`cancel` is called."""
    make: CheckFactory = case.factory or record.factory

    class Wrapped(HealthCheck[Any]):
        def __init__(self, options: Any, context: CheckContext) -> None:
            super().__init__(options, context)
            self.inner = make(options, context)

        def run(self) -> list[DeviceResult]:
            try:
                if behaviour is not None:
                    return behaviour(self.inner, probe)
                return self.inner.run()
            finally:
                probe.finished.set()

        def cancel(self) -> None:
            probe.cancelled.set()
            self.inner.cancel()

    return HealthCheckRecord(
        name=record.name, factory=Wrapped, options=record.options, summary=record.summary
    )


def run_check(
    record: HealthCheckRecord, case: CheckCase, context: CheckContext, timeout: float = 60.0
) -> CheckResult:
    """Run one case of ``record``'s check through planaria's runner (its thread, its
    ``timeout``), as ``planaria check`` does, for a plugin's own tests of a verdict or a detail.
    Options that do not validate are the :class:`~planaria.errors.ConfigError` a config file's
    would be."""
    options = validate_options(record, dict(case.options))
    if case.factory is not None:
        record = _wrapped(record, case, _Probe())
    configured = ConfiguredCheck(record.name, record, options, timeout)
    (result,) = run_checks([configured], context).checks
    return result


def _raise_after_run(inner: AnyCheck, probe: _Probe) -> list[DeviceResult]:
    inner.run()
    raise RuntimeError("conformance: the check raised")


def _hang_after_run(grace: float) -> Callable[[AnyCheck, _Probe], list[DeviceResult]]:
    """Answer, then block until the runner cancels (for at most ``grace`` seconds, so that a
    runner that never cancels fails the test instead of hanging it)."""

    def behaviour(inner: AnyCheck, probe: _Probe) -> list[DeviceResult]:
        try:
            results = inner.run()
        except Exception:
            # On a busy machine the check's own run may outlast the timeout: the runner's
            # cancel() then ends it (a subprocess killed), which releases it all the same.
            probe.released_by_cancel = probe.cancelled.is_set()
            raise
        probe.released_by_cancel = probe.cancelled.wait(grace)
        return results

    return behaviour


class HealthCheckConformance:
    """Tests every health check must pass; see the module docstring."""

    check_name: ClassVar[str | None] = None
    """The installed check's name: the default ``record`` fixture resolves it."""
    can_be_healthy: ClassVar[bool] = True
    can_be_unhealthy: ClassVar[bool] = True
    can_be_not_applicable: ClassVar[bool] = True
    """``False`` for a check whose subject is always there (the host's disk and memory)."""
    can_be_degraded: ClassVar[bool] = False
    """``True`` when the check has a ``degraded`` verdict (and a ``degraded`` case for it)."""
    can_hang: ClassVar[bool] = False
    """``True`` when the check waits on something that can hang (a tool, a driver call)."""
    can_be_undecidable: ClassVar[bool] = False
    timeout: ClassVar[float] = 60.0
    """The runner's timeout for the ordinary cases."""
    hang_timeout: ClassVar[float] = 0.5
    """The runner's timeout in the tests of a hanging check."""
    cancel_grace: ClassVar[float] = 30.0
    """How long :meth:`~planaria.health.api.HealthCheck.run` may take to end once cancelled."""

    # -- what the subclass provides ----------------------------------------------------------

    @pytest.fixture
    def record(self) -> HealthCheckRecord:
        if self.check_name is None:
            pytest.fail(
                "a HealthCheckConformance subclass must set check_name (the installed check's "
                "name) or define a `record` fixture returning its HealthCheckRecord"
            )
        found = PluginManager.from_entry_points().resolve(PluginKind.HEALTH_CHECK, self.check_name)
        assert isinstance(found, HealthCheckRecord)
        return found

    @pytest.fixture
    def check_context(self, tmp_path: Path) -> CheckContext:
        workdir = tmp_path / "conformance-workdir"
        workdir.mkdir(exist_ok=True)
        return CheckContext(node="conformance-node", workdir=workdir)

    @pytest.fixture
    def healthy(self) -> CheckCase:
        _missing("healthy", "the check finds the node healthy", "can_be_healthy = False")

    @pytest.fixture
    def unhealthy(self) -> CheckCase:
        _missing("unhealthy", "the check fails the node", "can_be_unhealthy = False")

    @pytest.fixture
    def not_applicable(self) -> CheckCase:
        _missing("not_applicable", "the hardware or its driver is missing",
                 "can_be_not_applicable = False")  # fmt: skip

    @pytest.fixture
    def degraded(self) -> CheckCase:
        _missing("degraded", "the check finds the node usable but impaired",
                 "can_be_degraded = False")  # fmt: skip

    @pytest.fixture
    def hanging(self) -> CheckCase:
        _missing("hanging", "the check's run() blocks", "can_hang = False")

    @pytest.fixture
    def undecidable(self) -> CheckCase:
        _missing("undecidable", "the check cannot reach a verdict", "can_be_undecidable = False")

    @pytest.fixture
    def any_case(self, request: pytest.FixtureRequest) -> CheckCase:
        """The first case this check has: what the kit's own wrappers run."""
        names = self.verdict_cases()
        if not names:
            pytest.fail("a health check needs one of the healthy, unhealthy, not_applicable cases")
        case: CheckCase = request.getfixturevalue(names[0])
        return case

    # -- helpers -----------------------------------------------------------------------------

    def run_case(
        self,
        record: HealthCheckRecord,
        case: CheckCase,
        context: CheckContext,
        timeout: float | None = None,
    ) -> CheckResult:
        """Run one case through the runner and return its result (:func:`run_check`, with the
        suite's timeout; options that do not validate fail the test)."""
        if case.factory is not None:
            record = _wrapped(record, case, _Probe())
        (result,) = run_checks([self._configured(record, case, timeout)], context).checks
        return result

    def _configured(
        self, record: HealthCheckRecord, case: CheckCase, timeout: float | None = None
    ) -> ConfiguredCheck:
        try:
            options = record.options.model_validate(dict(case.options))
        except ValidationError as exc:
            pytest.fail(f"the case's options are not valid for {record.name}: {exc}")
        return ConfiguredCheck(record.name, record, options, timeout or self.timeout)

    def verdict_cases(self) -> list[str]:
        """The names of the case fixtures this check declares it has."""
        flags = (
            self.can_be_healthy,
            self.can_be_unhealthy,
            self.can_be_degraded,
            self.can_be_not_applicable,
        )
        names = ("healthy", "unhealthy", "degraded", "not_applicable")
        return [name for flag, name in zip(flags, names, strict=True) if flag]

    def _run_named(
        self,
        flag: bool,
        name: str,
        record: HealthCheckRecord,
        request: pytest.FixtureRequest,
        context: CheckContext,
    ) -> CheckResult:
        if not flag:
            pytest.skip(f"this check declares it has no {name} case")
        return self.run_case(record, request.getfixturevalue(name), context)

    # -- the record --------------------------------------------------------------------------

    def test_record(self, record: HealthCheckRecord) -> None:
        assert isinstance(record, HealthCheckRecord), f"{record!r} is not a HealthCheckRecord"
        assert record.name == normalize_name(record.name)
        assert isinstance(record.factory, type) and issubclass(record.factory, HealthCheck)
        summary = record.summary
        assert summary, f"{record.name}: the record needs a summary (planaria plugins shows it)"
        assert "\n" not in summary and len(summary) <= SUMMARY_CHARS, (
            f"{record.name}: the summary must be one short line, got {summary!r}"
        )

    def test_options_forbid_unknown_keys(
        self, record: HealthCheckRecord, any_case: CheckCase
    ) -> None:
        with pytest.raises(ValidationError) as exc:
            record.options.model_validate({**any_case.options, UNKNOWN_KEY: 1})
        assert UNKNOWN_KEY in str(exc.value)
        assert record.options.model_config.get("extra") == "forbid"
        # planaria config schema publishes every installed check's options.
        schema = record.options.model_json_schema()
        assert schema.get("additionalProperties") is False

    # -- verdicts ----------------------------------------------------------------------------

    def test_healthy(
        self, record: HealthCheckRecord, request: pytest.FixtureRequest, check_context: CheckContext
    ) -> None:
        result = self._run_named(self.can_be_healthy, "healthy", record, request, check_context)
        assert result.error is None, f"the healthy case is an error: {result.error}"
        assert result.devices, "a healthy verdict names the devices it checked"
        assert result.status is Status.OK, _describe(result)

    def test_unhealthy_with_reasons(
        self, record: HealthCheckRecord, request: pytest.FixtureRequest, check_context: CheckContext
    ) -> None:
        result = self._run_named(self.can_be_unhealthy, "unhealthy", record, request, check_context)
        assert result.error is None, f"the unhealthy case is an error: {result.error}"
        assert result.status is Status.FAILED, _describe(result)
        failed = [d for d in result.devices if d.status is Status.FAILED]
        assert failed and all(d.detail.strip() for d in failed), (
            "every failed device says why in its detail: " + _describe(result)
        )
        assert not result.status.healthy

    def test_degraded_with_reasons(
        self, record: HealthCheckRecord, request: pytest.FixtureRequest, check_context: CheckContext
    ) -> None:
        result = self._run_named(self.can_be_degraded, "degraded", record, request, check_context)
        assert result.error is None, f"the degraded case is an error: {result.error}"
        assert result.status is Status.DEGRADED, _describe(result)
        degraded = [d for d in result.devices if d.status is Status.DEGRADED]
        assert degraded and all(d.detail.strip() for d in degraded), (
            "every degraded device says why in its detail: " + _describe(result)
        )
        assert result.status.healthy, "a degraded node still trains"

    def test_not_applicable_is_said_not_raised(
        self, record: HealthCheckRecord, request: pytest.FixtureRequest, check_context: CheckContext
    ) -> None:
        result = self._run_named(
            self.can_be_not_applicable, "not_applicable", record, request, check_context
        )
        assert result.error is None, (
            f"missing hardware or a missing driver must be not_applicable, never an error: "
            f"{result.error}"
        )
        assert result.status is Status.NOT_APPLICABLE, _describe(result)
        assert result.devices and all(d.detail.strip() for d in result.devices), (
            "a not_applicable result says what is missing: " + _describe(result)
        )
        assert result.status.healthy

    def test_undecidable_is_an_error_with_the_check_s_message(
        self, record: HealthCheckRecord, request: pytest.FixtureRequest, check_context: CheckContext
    ) -> None:
        result = self._run_named(
            self.can_be_undecidable, "undecidable", record, request, check_context
        )
        assert result.status is Status.ERROR, _describe(result)
        assert result.error, "the error verdict carries the check's message"
        assert not result.error.startswith("check crashed"), (
            f"a check that cannot decide raises HealthCheckError with a message that says why, "
            f"instead of crashing: {result.error}"
        )

    # -- devices and metrics -----------------------------------------------------------------

    def test_devices_and_metrics(
        self, record: HealthCheckRecord, request: pytest.FixtureRequest, check_context: CheckContext
    ) -> None:
        problems: list[str] = []
        for name in self.verdict_cases():
            result = self.run_case(record, request.getfixturevalue(name), check_context)
            if result.error is not None:  # no devices to look at
                problems.append(f"{name}: the case is an error: {result.error}")
            problems += [f"{name}: {p}" for p in _device_problems(result)]
        assert not problems, "\n".join(problems)

    # -- the runner's isolation --------------------------------------------------------------

    def test_a_raising_check_is_an_error_and_hides_no_other(
        self, record: HealthCheckRecord, any_case: CheckCase, check_context: CheckContext
    ) -> None:
        raising = _wrapped(record, any_case, _Probe(), _raise_after_run)
        plain = _wrapped(record, any_case, _Probe())
        options = self._configured(plain, any_case).options
        checks = [
            ConfiguredCheck(record.name, raising, options, self.timeout),
            ConfiguredCheck("sibling", plain, options, self.timeout),
        ]
        crashed, sibling = run_checks(checks, check_context).checks
        assert crashed.status is Status.ERROR
        assert crashed.error is not None and "RuntimeError: conformance" in crashed.error
        assert sibling.status is not Status.ERROR, _describe(sibling)

    def test_a_hanging_check_is_cancelled_within_its_timeout(
        self, record: HealthCheckRecord, any_case: CheckCase, check_context: CheckContext
    ) -> None:
        probe = _Probe()
        hanging = _wrapped(record, any_case, probe, _hang_after_run(self.cancel_grace))
        plain = _wrapped(record, any_case, _Probe())
        options = self._configured(plain, any_case).options
        checks = [
            ConfiguredCheck(record.name, hanging, options, self.hang_timeout),
            ConfiguredCheck("sibling", plain, options, self.timeout),
        ]
        hung, sibling = run_checks(checks, check_context).checks
        assert hung.status is Status.ERROR
        assert hung.error == f"timed out after {self.hang_timeout:g}s"
        assert hung.duration_s >= self.hang_timeout
        assert sibling.status is not Status.ERROR, _describe(sibling)
        assert probe.cancelled.wait(self.cancel_grace), "the runner never called cancel()"
        assert probe.finished.wait(self.cancel_grace)
        assert probe.released_by_cancel, "run() was still blocked when the runner answered"

    def test_its_own_hang_ends_when_cancelled(
        self, record: HealthCheckRecord, request: pytest.FixtureRequest, check_context: CheckContext
    ) -> None:
        if not self.can_hang:
            pytest.skip("this check declares it has no hanging case")
        case: CheckCase = request.getfixturevalue("hanging")
        probe = _Probe()
        wrapped = _wrapped(record, case, probe)
        configured = self._configured(wrapped, case, self.hang_timeout)
        (result,) = run_checks([configured], check_context).checks
        assert result.status is Status.ERROR, _describe(result)
        assert result.error == f"timed out after {self.hang_timeout:g}s", (
            f"the hanging case did not hang: {_describe(result)}"
        )
        assert probe.cancelled.wait(self.cancel_grace), "the runner never called cancel()"
        assert probe.finished.wait(self.cancel_grace), (
            f"run() did not end within {self.cancel_grace:g}s of cancel(): cancel() must "
            "release what run() waits on (kill its process, close its handle)"
        )


def _missing(fixture: str, case: str, flag: str) -> NoReturn:
    pytest.fail(f"define a `{fixture}` fixture: a CheckCase in which {case}; or set {flag}")


def _describe(result: CheckResult) -> str:
    devices = "; ".join(f"{d.device}={d.status.value} ({d.detail})" for d in result.devices)
    return f"{result.check}: {result.status.value}, error={result.error!r}, devices: {devices}"


def _device_problems(result: CheckResult) -> Iterator[str]:
    names = [d.device for d in result.devices]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        yield f"devices reported twice: {duplicates}"
    for device in result.devices:
        if not isinstance(device, DeviceResult):
            yield f"{device!r} is not a DeviceResult"
            continue
        if not device.device.strip():
            yield "a device without a name"
        if "\n" in device.detail:
            yield f"{device.device}: the detail must be one line, got {device.detail!r}"
        for name, value in device.metrics.items():
            if not METRIC_NAME.match(name):
                yield f"{device.device}: metric name {name!r} is not lower-case snake case"
            if type(value) not in (int, float):
                yield f"{device.device}: metric {name} is a {type(value).__name__}, not a number"
            elif not math.isfinite(value):
                yield f"{device.device}: metric {name} is {value}"
