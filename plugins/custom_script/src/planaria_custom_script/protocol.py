"""The contract between planaria and a user's script: exit code plus JSON lines on stdout.

Exit 0 means healthy, 1 unhealthy, anything else (or a signal) means the script itself broke.
Each non-blank stdout line is one device's verdict::

    {"device": "npu3", "status": "failed", "detail": "HBM ECC errors", "metrics": {"ecc": 12}}

The parser is strict on purpose: a script that prints something else is broken, and guessing
would turn a broken check into a silently passing one.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from planaria.errors import HealthCheckError
from planaria.plugin import DeviceResult, Status
from planaria.process import signal_name

STATUSES: dict[str, Status] = {
    "ok": Status.OK,
    "degraded": Status.DEGRADED,
    "failed": Status.FAILED,
    "not_applicable": Status.NOT_APPLICABLE,
}
KEYS = ("device", "status", "detail", "metrics")

EXIT_HEALTHY = 0
EXIT_UNHEALTHY = 1

QUOTE_LIMIT = 200
"""Characters of a bad line or a stderr line quoted in an error."""

STDERR_LINES = 5
"""Lines from the end of stderr quoted in an error."""


class BadLine(ValueError):
    """One stdout line broke the protocol; the message says how."""


def _reject_constant(name: str) -> float:
    raise BadLine(f"{name} is not a number in strict JSON")


def parse_line(text: str) -> DeviceResult:
    """One JSON object -> one :class:`DeviceResult`; :class:`BadLine` saying what is wrong."""
    try:
        obj: Any = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise BadLine(f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise BadLine(f"expected a JSON object, got {_json_type(obj)}")
    unknown = sorted(set(obj) - set(KEYS))
    if unknown:
        raise BadLine(f"unknown key(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(KEYS)}")
    device = obj.get("device")
    if not isinstance(device, str) or not device.strip():
        raise BadLine('"device" must be a non-empty string')
    status = obj.get("status")
    if not isinstance(status, str) or status not in STATUSES:
        raise BadLine(f'"status" must be one of {", ".join(map(repr, STATUSES))}, got {status!r}')
    detail = obj.get("detail", "")
    if not isinstance(detail, str):
        raise BadLine(f'"detail" must be a string, got {_json_type(detail)}')
    return DeviceResult(
        device=device,
        status=STATUSES[status],
        detail=detail,
        metrics=_metrics(obj.get("metrics", {})),
    )


def _metrics(value: Any) -> dict[str, float]:
    if not isinstance(value, dict):
        raise BadLine(f'"metrics" must be an object of numbers, got {_json_type(value)}')
    metrics: dict[str, float] = {}
    for name, number in value.items():
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            raise BadLine(f"metric {name!r} must be a number, got {_json_type(number)}")
        try:
            metrics[name] = float(number)
        except OverflowError:
            raise BadLine(f"metric {name!r} is too large") from None
        if not math.isfinite(metrics[name]):
            raise BadLine(f"metric {name!r} is not finite")
    return metrics


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return "a number"
    return names.get(type(value), type(value).__name__)


def quote(text: str, limit: int = QUOTE_LIMIT) -> str:
    """``text`` cut to ``limit`` characters, marked when cut, as a Python literal."""
    if len(text) > limit:
        return repr(text[:limit]) + f"... ({len(text)} characters)"
    return repr(text)


def parse_stdout(script: Path, stdout: str) -> list[DeviceResult]:
    """Every non-blank line's result, or a :class:`HealthCheckError` on the first bad line."""
    results: list[DeviceResult] = []
    first_bad: tuple[int, str, BadLine] | None = None
    bad = 0
    # Split on newlines only: U+2028 and friends may sit inside a JSON string.
    for number, line in enumerate(stdout.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            results.append(parse_line(line))
        except BadLine as exc:
            bad += 1
            first_bad = first_bad or (number, line, exc)
    if first_bad is not None:
        where, text, reason = first_bad
        more = f" ({bad - 1} more bad line{'s' if bad > 2 else ''} after it)" if bad > 1 else ""
        raise HealthCheckError(
            f"custom script {script} broke the output protocol on stdout line {where}: {reason}; "
            f"the line was {quote(text)}{more}. Each stdout line must be a JSON object such as "
            '{"device": "gpu0", "status": "ok"}; write diagnostics to stderr'
        )
    return results


def last_lines(stderr: str, count: int = STDERR_LINES) -> list[str]:
    """The last ``count`` non-blank lines of stderr, each cut to a readable length."""
    lines = [line.rstrip() for line in stderr.splitlines() if line.strip()]
    return [line if len(line) <= QUOTE_LIMIT else line[:QUOTE_LIMIT] + "..." for line in lines][
        -count:
    ]


def _stderr_excerpt(stderr: str) -> str:
    lines = last_lines(stderr)
    if not lines:
        return "; stderr was empty"
    return "; last lines of stderr:\n" + "\n".join(f"  | {line}" for line in lines)


def _describe_exit(returncode: int) -> str:
    if returncode < 0:
        return f"was killed by signal {-returncode} ({signal_name(-returncode)})"
    return f"exited with code {returncode} (0 means healthy, 1 unhealthy, anything else an error)"


def verdict(script: Path, returncode: int, stdout: str, stderr: str) -> list[DeviceResult]:
    """Results of a finished script, or a :class:`HealthCheckError` when it broke the protocol."""
    if returncode not in (EXIT_HEALTHY, EXIT_UNHEALTHY):
        raise HealthCheckError(
            f"custom script {script} {_describe_exit(returncode)}{_stderr_excerpt(stderr)}"
        )
    results = parse_stdout(script, stdout)
    if returncode == EXIT_UNHEALTHY and not any(r.status is Status.FAILED for r in results):
        lines = last_lines(stderr, 1)
        results.append(
            DeviceResult(
                device=script.name,
                status=Status.FAILED,
                detail=lines[0] if lines else f"exited with {EXIT_UNHEALTHY}",
            )
        )
    if returncode == EXIT_HEALTHY and not results:
        results.append(
            DeviceResult(device=script.name, status=Status.OK, detail=f"exited {EXIT_HEALTHY}")
        )
    return results
