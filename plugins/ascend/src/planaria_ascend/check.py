"""The ``ascend`` health check: Huawei Ascend NPUs through torch_npu and npu-smi.

npu-smi (installed with the NPU driver) gives each chip's health, temperature and memory
errors; torch_npu, when installed, tells whether training can use the chips at all. Neither
present: the node has no Ascend NPU, and the check is ``not_applicable``.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field

from planaria.errors import HealthCheckError
from planaria.plugin import CheckContext, DeviceResult, HealthCheck, Status
from planaria_ascend import torch_probe
from planaria_ascend.commands import CommandCancelled, Outcome, Runner
from planaria_ascend.npu_smi import Chip, NpuSmiParseError, field_number, parse_fields, parse_info
from planaria_ascend.options import AscendOptions
from planaria_ascend.torch_probe import TorchNpu

HEALTH = {
    "ok": Status.OK,
    "warning": Status.DEGRADED,  # a minor alarm
    "alarm": Status.FAILED,  # a major alarm
    "critical": Status.FAILED,  # an urgent alarm
}


@dataclass
class _Findings:
    problems: list[tuple[Status, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)

    def result(self, device: str, summary: str) -> DeviceResult:
        status = Status.worst([s for s, _ in self.problems], default=Status.OK)
        parts = [m for _, m in sorted(self.problems, key=lambda p: -p[0].severity)] or [summary]
        return DeviceResult(
            device=device,
            status=status,
            detail="; ".join(parts + self.notes),
            metrics=self.metrics,
        )


class AscendCheck(HealthCheck[AscendOptions]):
    name = "ascend"

    def __init__(self, options: AscendOptions, context: CheckContext) -> None:
        super().__init__(options, context)
        self._runner = Runner()

    def cancel(self) -> None:
        self._runner.cancel()

    def run(self) -> list[DeviceResult]:
        smi = self._find_npu_smi()
        torch_npu = (
            torch_probe.probe(self._runner, self.options.torch_npu_timeout)
            if self.options.torch_npu
            else None
        )
        if smi is None:
            return self._without_npu_smi(torch_npu)
        chips = self._chips(smi)
        results = [self._inventory(len(chips), f"{len(chips)} NPU chip(s) in npu-smi")]
        results += [self._chip(smi, chip) for chip in chips]
        if torch_npu is not None and torch_npu.installed:
            results.append(self._torch_result(torch_npu, len(chips)))
        return results

    # -- presence ----------------------------------------------------------------------------
    def _find_npu_smi(self) -> str | None:
        name = self.options.npu_smi
        if os.sep in name:
            return name if os.access(name, os.X_OK) and os.path.isfile(name) else None
        return shutil.which(name)

    def _without_npu_smi(self, torch_npu: TorchNpu | None) -> list[DeviceResult]:
        missing = f"{self.options.npu_smi} is not found (PATH={os.environ.get('PATH', '')})"
        if torch_npu is None or not torch_npu.installed:
            why = "torch_npu is not installed" if torch_npu is not None else "torch_npu not probed"
            return [
                DeviceResult(
                    device="ascend",
                    status=Status.NOT_APPLICABLE,
                    detail=f"no Ascend NPU software on this node: {missing}, and {why}",
                )
            ]
        if not torch_npu.loaded:
            # No driver tool and a torch_npu that cannot load: a node without NPUs whose image
            # carries torch_npu. Nothing to check, but training must not autoload it.
            return [
                DeviceResult(
                    device="ascend",
                    status=Status.NOT_APPLICABLE,
                    detail=f"no Ascend driver on this node ({missing}); {torch_npu.failure}",
                )
            ]
        results = [self._inventory(torch_npu.count, f"{torch_npu.count} NPU(s) in torch_npu")]
        results += [
            DeviceResult(
                device=f"npu{i}",
                status=Status.OK,
                detail=f"{name} (torch_npu); health not read: {missing}",
            )
            for i, name in enumerate(torch_npu.names)
        ]
        return results

    def _inventory(self, count: int, found: str) -> DeviceResult:
        expected = self.options.expected_devices
        metrics = {"devices": float(count)}
        if expected is not None and count != expected:
            return DeviceResult(
                device="ascend",
                status=Status.FAILED,
                detail=f"found {count} NPU chip(s), expected {expected}",
                metrics=metrics,
            )
        if count == 0:
            return DeviceResult(
                device="ascend", status=Status.FAILED, detail=f"no NPU found ({found})"
            )
        return DeviceResult(device="ascend", status=Status.OK, detail=found, metrics=metrics)

    def _torch_result(self, torch_npu: TorchNpu, chips: int) -> DeviceResult:
        if not torch_npu.loaded:
            return DeviceResult(device="torch_npu", status=Status.FAILED, detail=torch_npu.failure)
        visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
        expected = len([v for v in visible.split(",") if v.strip()]) if visible else chips
        where = f"ASCEND_RT_VISIBLE_DEVICES={visible}" if visible else "npu-smi"
        metrics = {"devices": float(torch_npu.count)}
        if torch_npu.count != expected:
            return DeviceResult(
                device="torch_npu",
                status=Status.FAILED,
                detail=f"torch_npu sees {torch_npu.count} NPU(s), {where} {expected}",
                metrics=metrics,
            )
        return DeviceResult(
            device="torch_npu",
            status=Status.OK,
            detail=f"torch_npu loads and sees {torch_npu.count} NPU(s)",
            metrics=metrics,
        )

    # -- npu-smi -----------------------------------------------------------------------------
    def _npu_smi(self, smi: str, *args: str) -> Outcome:
        argv = [smi, *args]
        command = " ".join(["npu-smi", *args])
        try:
            outcome = self._runner.run(argv, self.options.command_timeout)
        except CommandCancelled:
            raise
        except OSError as exc:
            raise HealthCheckError(f"{command} could not be started ({smi}): {exc}") from exc
        if outcome.returncode != 0:
            raise HealthCheckError(
                f"{command} exited with code {outcome.returncode}: {outcome.tail() or 'no output'}"
            )
        return outcome

    def _chips(self, smi: str) -> list[Chip]:
        outcome = self._npu_smi(smi, "info")
        try:
            return parse_info(outcome.stdout).chips
        except NpuSmiParseError as exc:
            raise HealthCheckError(f"cannot understand the output of npu-smi info: {exc}") from exc

    def _query(self, smi: str, kind: str, chip: Chip) -> dict[str, str]:
        args = ("info", "-t", kind, "-i", str(chip.npu), "-c", str(chip.chip))
        outcome = self._npu_smi(smi, *args)
        try:
            return parse_fields(outcome.stdout)
        except NpuSmiParseError as exc:
            raise HealthCheckError(
                f"cannot understand the output of npu-smi {' '.join(args)}: {exc}"
            ) from exc

    def _chip(self, smi: str, chip: Chip) -> DeviceResult:
        device = f"npu{chip.npu}" + (f".{chip.chip}" if chip.chip else "")
        findings = _Findings()
        try:
            self._health(smi, chip, findings)
            self._ecc(smi, chip, findings)
            temperature = self._temperature(smi, chip, findings)
        except CommandCancelled:
            raise
        except HealthCheckError as exc:
            # One chip's query failing says nothing of the others; that chip cannot be
            # verified, so it is not trusted ('error' is the runner's verdict on a check).
            findings.problems.append((Status.FAILED, str(exc)))
            temperature = None
        usage = chip.usage("HBM-Usage(MB)") or chip.usage("Memory-Usage(MB)")
        if usage is not None:
            findings.metrics["memory_used_mb"], findings.metrics["memory_total_mb"] = usage
        power = chip.number("Power(W)")
        if power is not None:
            findings.metrics["power_w"] = power
        summary = chip.name + (f", {temperature:g} C" if temperature is not None else "")
        return findings.result(device, summary)

    def _health(self, smi: str, chip: Chip, findings: _Findings) -> None:
        status = HEALTH.get(chip.health.lower())
        if status is Status.OK:
            return
        if status is None:
            findings.problems.append(
                (Status.FAILED, f"npu-smi reports an unknown health {chip.health!r}")
            )
            return
        fields = self._query(smi, "health", chip)
        codes = [
            v
            for v in (fields.get("Error Code"), fields.get("Error Information"))
            if v and v.upper() != "NA"
        ]
        findings.problems.append(
            (status, f"health {chip.health}" + (f": {' '.join(codes)}" if codes else ""))
        )

    def _ecc(self, smi: str, chip: Chip, findings: _Findings) -> None:
        fields = self._query(smi, "ecc", chip)
        double = field_number(fields, "HBM Double Bit Error Count", "DDR Double Bit Error Count")
        single = field_number(fields, "HBM Single Bit Error Count", "DDR Single Bit Error Count")
        isolated = field_number(
            fields, "HBM Double Bit Isolated Pages Count", "DDR Double Bit Isolated Pages Count"
        )
        for key, value in (
            ("ecc_double_bit_errors", double),
            ("ecc_single_bit_errors", single),
            ("ecc_isolated_pages", isolated),
        ):
            if value is not None:
                findings.metrics[key] = value
        if double is None:
            findings.notes.append("ECC counts not reported")
            return
        limit = self.options.max_hbm_double_bit_errors
        if double > limit:
            findings.problems.append(
                (Status.FAILED, f"{double:g} uncorrectable (double-bit) ECC error(s) (max {limit})")
            )

    def _temperature(self, smi: str, chip: Chip, findings: _Findings) -> float | None:
        temperature = chip.number("Temp(C)")
        if temperature is None:  # not in this model's table, or NA there: ask for it
            fields = self._query(smi, "temp", chip)
            temperature = field_number(fields, "NPU Temperature (C)", "Temperature (C)")
        if temperature is None:
            findings.notes.append("temperature not reported")
            return None
        findings.metrics["temperature_c"] = temperature
        limit = self.options.max_temperature
        if temperature > limit:
            findings.problems.append(
                (Status.DEGRADED, f"temperature {temperature:g} C (max {limit} C)")
            )
        return temperature
