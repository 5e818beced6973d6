"""The ``custom_script`` health check: any chip, checked by the user's own executable.

A vendor without a planaria plugin, or a site with its own burn-in tool, writes a script that
prints one JSON line per device (see :mod:`planaria_custom_script.protocol`). The script never
runs through a shell, and nothing it starts outlives the check.
"""

from __future__ import annotations

import os
import threading

from planaria.errors import HealthCheckError
from planaria.plugin import CheckContext, DeviceResult, HealthCheck
from planaria_custom_script.options import CustomScriptOptions
from planaria_custom_script.process_group import STDOUT_LIMIT, ProcessGroup
from planaria_custom_script.protocol import verdict

NODE_ENV = "PLANARIA_NODE"
"""Set for the script to the name of the node it checks."""


class CustomScriptCheck(HealthCheck[CustomScriptOptions]):
    """Runs ``[path, *args]`` in its own process group with a timeout and reads its verdict."""

    name = "custom_script"

    def __init__(self, options: CustomScriptOptions, context: CheckContext) -> None:
        super().__init__(options, context)
        self._lock = threading.Lock()
        self._group: ProcessGroup | None = None
        self._cancelled = False

    def run(self) -> list[DeviceResult]:
        opts = self.options
        script = opts.path
        workdir = self.context.workdir
        if not workdir.is_dir():
            raise HealthCheckError(
                f"custom script {script} cannot run: work dir {workdir} is missing"
            )
        env = {**os.environ, NODE_ENV: self.context.node, **opts.env}
        group = ProcessGroup([str(script), *opts.args], workdir, env, opts.kill_grace)
        with self._lock:
            if self._cancelled:
                raise HealthCheckError(f"custom script {script} was cancelled before it started")
            try:
                group.start()
            except (OSError, ValueError) as exc:
                raise HealthCheckError(
                    f"custom script {script} could not be started: {exc}"
                ) from exc
            self._group = group

        finished = group.wait(opts.timeout)
        if not finished:
            group.kill()
        outcome = group.finish()
        if not finished:
            raise HealthCheckError(
                f"custom script {script} timed out after {opts.timeout:g}s; "
                "its process group was killed"
            )
        if self._cancelled:
            raise HealthCheckError(
                f"custom script {script} was cancelled by the check runner (it overran the "
                "runner's timeout); its process group was killed"
            )
        if outcome.stdout_truncated:
            raise HealthCheckError(
                f"custom script {script} wrote more than {STDOUT_LIMIT >> 20} MiB on stdout; "
                "the protocol expects one short JSON line per device"
            )
        stdout = outcome.stdout.decode("utf-8", errors="replace")
        stderr = outcome.stderr.decode("utf-8", errors="replace")
        return verdict(script, outcome.returncode, stdout, stderr)

    def cancel(self) -> None:
        """Kill the script's whole process group; the runner has given up on :meth:`run`."""
        with self._lock:
            self._cancelled = True
            group = self._group
        if group is not None:
            group.kill()
