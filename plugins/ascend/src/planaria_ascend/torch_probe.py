"""Whether torch_npu loads, asked of a separate Python process.

torch_npu registers itself as a torch device backend, so on a node where it is installed but
CANN (the Ascend runtime) is missing or broken, ``import torch`` itself fails unless
``TORCH_DEVICE_BACKEND_AUTOLOAD=0``. The checking process (the agent) must never run that
import: it is probed in a child with autoloading off and a timeout, and only
``importlib.util.find_spec`` (which executes nothing) runs here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from dataclasses import dataclass, field

from planaria_ascend.commands import CommandTimeout, Runner

MARKER = "planaria-torch-npu-probe:"

PROBE = f"""
import json
try:
    import torch_npu
    count = int(torch_npu.npu.device_count())
    names = [str(torch_npu.npu.get_device_name(i)) for i in range(count)]
    result = {{"loaded": True, "count": count, "names": names}}
except BaseException as exc:
    result = {{"loaded": False, "error": f"{{type(exc).__name__}}: {{exc}}"}}
print({MARKER!r} + json.dumps(result), flush=True)
"""

ADVICE = (
    "set TORCH_DEVICE_BACKEND_AUTOLOAD=0 so that `import torch` works without it, "
    "or install CANN and source its set_env.sh"
)


@dataclass(frozen=True)
class TorchNpu:
    installed: bool
    loaded: bool = False
    count: int = 0
    names: list[str] = field(default_factory=list)
    reason: str = ""

    @property
    def failure(self) -> str:
        return f"torch_npu is installed but cannot load: {self.reason}; {ADVICE}"


def installed() -> bool:
    return importlib.util.find_spec("torch_npu") is not None


def probe(runner: Runner, timeout: float) -> TorchNpu:
    """Import torch_npu in a child process and count its devices."""
    if not installed():
        return TorchNpu(installed=False)
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    try:
        outcome = runner.run([sys.executable, "-c", PROBE], timeout, env=env)
    except CommandTimeout:
        return TorchNpu(installed=True, reason=f"importing it did not finish within {timeout:g}s")
    for line in reversed(outcome.stdout.splitlines()):
        if line.startswith(MARKER):
            data = json.loads(line[len(MARKER) :])
            if not data["loaded"]:
                return TorchNpu(installed=True, reason=str(data["error"]))
            return TorchNpu(
                installed=True,
                loaded=True,
                count=int(data["count"]),
                names=[str(n) for n in data["names"]],
            )
    return TorchNpu(
        installed=True,
        reason=f"the probe process exited with code {outcome.returncode}: {outcome.tail()}",
    )
