#!/usr/bin/env python3
"""Example planaria custom_script health check: copy it and replace probe().

It reports every thermal zone of this machine (/sys/class/thermal) as one device, so it runs
on any Linux host; on a machine without thermal zones it prints nothing and exits 0.

Protocol (see README.md): one JSON object per stdout line, diagnostics on stderr, and the
exit code 0 = healthy, 1 = unhealthy, anything else = the check itself broke.
"""

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

EXIT_HEALTHY, EXIT_UNHEALTHY, EXIT_BROKEN = 0, 1, 2


Finding = tuple[str, str, str, dict[str, float]]


def probe(zones: Path, max_temp: float, warn_temp: float) -> Iterator[Finding]:
    """Yield (device, status, detail, metrics) for each device. Replace this with your chip's."""
    for zone in sorted(zones.glob("thermal_zone*")):
        try:
            millidegrees = int((zone / "temp").read_text().strip())
        except (OSError, ValueError) as exc:
            # A sensor we cannot read is a finding about the device, not a broken script.
            yield zone.name, "degraded", f"cannot read temperature: {exc}", {}
            continue
        celsius = millidegrees / 1000
        if celsius >= max_temp:
            status = "failed"
        elif celsius >= warn_temp:
            status = "degraded"
        else:
            status = "ok"
        detail = f"{celsius:.1f} C (warn at {warn_temp:g}, fail at {max_temp:g})"
        yield zone.name, status, detail, {"temp_c": celsius}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-temp", type=float, default=95.0, help="fail at or above (C)")
    parser.add_argument("--warn-temp", type=float, default=85.0, help="degraded at or above (C)")
    parser.add_argument(
        "--zones", type=Path, default=Path("/sys/class/thermal"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()  # bad arguments exit with 2: planaria reports a check error

    unhealthy = False
    for device, status, detail, metrics in probe(args.zones, args.max_temp, args.warn_temp):
        line = {"device": device, "status": status, "detail": detail, "metrics": metrics}
        print(json.dumps(line), flush=True)
        unhealthy = unhealthy or status == "failed"
        if status != "ok":
            print(f"{device}: {detail}", file=sys.stderr)
    return EXIT_UNHEALTHY if unhealthy else EXIT_HEALTHY


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as exc:  # any surprise: say why on stderr and report a broken check
        print(f"check_example: {type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(EXIT_BROKEN)
