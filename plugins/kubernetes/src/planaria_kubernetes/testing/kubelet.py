"""The emulated kubelet: pods bound to the cluster's nodes become local processes.

For each pod bound to one of its Ready nodes, it runs the first container's ``command`` +
``args`` (``$(VAR)`` expanded as the real kubelet does) as a local process in a new session (its
own process group), in ``workingDir`` if set, with the harness process's own environment
overlaid with ``HOSTNAME`` (the pod's name) and the container's ``env``/``envFrom`` (``value``,
``secretKeyRef``, ``configMapKeyRef``, ``fieldRef``; ``secretRef``, ``configMapRef``), its
output to ``<log_dir>/<namespace>.<pod>.log``. It reports what a real kubelet reports through
the status: ``Running`` with ``podIP``/``hostIP`` the node's address, then ``Succeeded`` or
``Failed`` with the exit code (``128 + N`` for a process killed by signal N); images marked bad stay
``Pending`` with ``ErrImagePull`` then ``ImagePullBackOff``; a missing Secret or key keeps the
pod ``Pending`` with ``CreateContainerConfigError`` (retried, as the real kubelet does).

A node given a network namespace (``netns``) is a host of its own: its pods run inside it
(``ip netns exec``, which execs the command, so the pod's process keeps the pid the kubelet
started), and its address (``addresses``) is the pods' ``podIP`` and ``hostIP``, as for a pod
with ``hostNetwork: true`` on a real node: pods of one node share its address and ports, pods
of two nodes never do. A node without one is 127.0.0.1, as this machine.

``restartPolicy`` is treated as ``Never``: a process that exits ends its pod. Only the first
container runs; init containers, probes, volumes and resource limits are ignored. A pod without
``command`` cannot run here (there is no image to take an entrypoint from): it fails with
``StartError``, exit code 128, as a container whose executable is missing does.

A pod marked for deletion gets SIGTERM on its process group, SIGKILL after its grace period; its
final status is posted, then the pod is removed. When a pod is removed while its processes run
(a forced deletion), they are killed. A node that is not Ready has no kubelet: its pods are
left as they are (the processes too, unless the test killed them), even when deleted.

Why one module: :class:`Kubelet` is one loop over the pods of its nodes, from a pod bound to
its process started, watched, stopped and its pod removed; each step changes the same book of
running containers. What it reads from and writes to the pod objects is :mod:`.pods`'s.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from planaria.process import group_members
from planaria_kubernetes.testing import semantics
from planaria_kubernetes.testing.pods import (
    container_id,
    container_status,
    expand,
    field_value,
    set_conditions,
)
from planaria_kubernetes.testing.scheduler import is_terminal
from planaria_kubernetes.testing.semantics import Obj
from planaria_kubernetes.testing.store import Store

LOCALHOST = "127.0.0.1"
PULL_BACKOFF_AFTER = 1.0  # seconds of ErrImagePull before ImagePullBackOff


class ConfigError(Exception):
    """The container cannot be created: ``CreateContainerConfigError`` with this message."""


@dataclass
class Container:
    """One started process (the pod's first container)."""

    uid: str
    namespace: str
    pod: str
    node: str
    name: str
    image: str
    process: subprocess.Popen[bytes]
    log: IO[bytes]
    started_at: str
    term_sent: float | None = None
    kill_at: float | None = None
    reported: bool = False
    exit_code: int | None = None


@dataclass
class _Waiting:
    since: float
    reason: str = ""
    message: str = ""


@dataclass
class Kubelet:
    """The kubelets of all the cluster's nodes; runs in the API server's event loop."""

    store: Store
    nodes: set[str]
    log_dir: Path
    interval: float = 0.1
    bad_images: set[str] = field(default_factory=set)
    down: set[str] = field(default_factory=set)  # nodes whose kubelet is stopped
    containers: dict[str, Container] = field(default_factory=dict)  # by pod uid
    waiting: dict[str, _Waiting] = field(default_factory=dict)
    orphans: list[subprocess.Popen[bytes]] = field(default_factory=list)  # killed, not reaped
    addresses: dict[str, str] = field(default_factory=dict)
    """Each node's address (none: 127.0.0.1)."""
    netns: dict[str, str] = field(default_factory=dict)
    """Each node's network namespace, where its pods run (none: this machine's own)."""

    def address(self, node: str | None) -> str:
        return self.addresses.get(node or "", LOCALHOST)

    async def run(self) -> None:
        wakeup = asyncio.Event()
        self.store.listeners.append(wakeup)
        try:
            while True:
                try:
                    self.sync_once()
                except Exception:
                    self.store.report("the kubelet")
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(wakeup.wait(), self.interval)
                wakeup.clear()
        finally:
            self.store.listeners.remove(wakeup)

    # -- the loop -----------------------------------------------------------------------------

    def sync_once(self) -> None:
        pods = self.store.all("pods")
        alive_uids = {pod["metadata"]["uid"] for pod in pods}
        for pod in pods:
            node = (pod.get("spec") or {}).get("nodeName")
            if node not in self.nodes or node in self.down:
                continue
            try:
                self._sync_pod(pod)
            except Exception as exc:  # a bug here must not stop every other pod
                self.store.report(f"the kubelet, for pod {pod['metadata']['name']}")
                self._fail(pod, "StartError", f"emulated kubelet: {exc!r}", 128)
        for uid, container in list(self.containers.items()):
            if uid not in alive_uids and container.node not in self.down:
                # Removed while running (a forced deletion): kill it, reap it later.
                if not container.reported:
                    self._kill_group(container.process.pid, signal.SIGKILL)
                    self.orphans.append(container.process)
                self._forget(uid)
        self.orphans = [process for process in self.orphans if process.poll() is None]

    def _sync_pod(self, pod: Obj) -> None:
        meta = pod["metadata"]
        uid = meta["uid"]
        container = self.containers.get(uid)
        if container is not None and not container.reported:
            code = container.process.poll()
            if code is not None:
                container.exit_code = 128 - code if code < 0 else code
                self._kill_group(container.process.pid, signal.SIGKILL)
                container.reported = True
                self._report_exit(pod, container)
        if meta.get("deletionTimestamp"):
            self._terminate(pod, container)
            return
        if container is not None or is_terminal(pod):
            return
        self._start(pod)

    def _terminate(self, pod: Obj, container: Container | None) -> None:
        meta = pod["metadata"]
        if container is not None and not container.reported:
            now = time.monotonic()
            grace = int(meta.get("deletionGracePeriodSeconds") or 0)
            if container.term_sent is None:
                container.term_sent = now
                self._kill_group(container.process.pid, signal.SIGTERM)
            # A second deletion may shorten the grace period.
            kill_at = container.term_sent + grace
            if container.kill_at is None or kill_at < container.kill_at:
                container.kill_at = kill_at
            if now >= container.kill_at:
                self._kill_group(container.process.pid, signal.SIGKILL)
            return  # wait for it to exit: the next pass reports it, then removes the pod
        self.store.remove("pods", meta.get("namespace"), meta["name"])
        self._forget(meta["uid"])

    def _forget(self, uid: str) -> None:
        container = self.containers.pop(uid, None)
        if container is not None:
            with contextlib.suppress(OSError):
                container.log.close()
        self.waiting.pop(uid, None)

    # -- starting -----------------------------------------------------------------------------

    def _start(self, pod: Obj) -> None:
        meta = pod["metadata"]
        uid = meta["uid"]
        spec = pod.get("spec") or {}
        first: Obj = spec["containers"][0]
        image = str(first.get("image"))
        waiting = self.waiting.setdefault(uid, _Waiting(since=time.monotonic()))
        if image in self.bad_images:
            if time.monotonic() - waiting.since < PULL_BACKOFF_AFTER:
                reason = "ErrImagePull"
                message = (
                    f'failed to pull and unpack image "{image}": failed to resolve reference'
                    f' "{image}": not found'
                )
            else:
                reason, message = "ImagePullBackOff", f'Back-off pulling image "{image}"'
            self._wait(pod, waiting, reason, message)
            return
        try:
            env = self._environment(pod, first)
        except ConfigError as exc:
            self._wait(pod, waiting, "CreateContainerConfigError", str(exc))
            return
        command = [expand(part, env) for part in first.get("command") or []]
        command += [expand(part, env) for part in first.get("args") or []]
        if not first.get("command"):
            self._fail(
                pod,
                "StartError",
                "the emulated kubelet runs only a container's command (none given)",
                128,
            )
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{meta.get('namespace')}.{meta['name']}.log"
        log = log_path.open("ab")
        full_env = dict(os.environ)
        full_env["HOSTNAME"] = str(spec.get("hostname") or meta["name"])
        full_env.update(env)
        node = str(spec["nodeName"])
        netns = self.netns.get(node)
        try:
            if netns:
                # `ip netns exec` would start and then fail to exec a missing program: find it
                # first, so that it fails here as a container runtime's does.
                _find_program(command[0], first.get("workingDir"), full_env.get("PATH"))
                command = ["ip", "netns", "exec", netns, *command]
            process = subprocess.Popen(
                command,
                cwd=first.get("workingDir") or None,
                env=full_env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as exc:
            log.close()
            self._fail(
                pod,
                "StartError",
                f"failed to create containerd task: failed to create shim task: OCI runtime"
                f" create failed: exec: {command[0]!r}: {exc.strerror}",
                128,
            )
            return
        container = Container(
            uid=uid,
            namespace=str(meta.get("namespace")),
            pod=meta["name"],
            node=node,
            name=str(first.get("name")),
            image=image,
            process=process,
            log=log,
            started_at=semantics.timestamp(),
        )
        self.containers[uid] = container
        self.waiting.pop(uid, None)

        address = self.address(node)

        def running(obj: Obj) -> None:
            status = obj.setdefault("status", {})
            status.update(
                {
                    "phase": "Running",
                    "hostIP": address,
                    "hostIPs": [{"ip": address}],
                    "podIP": address,
                    "podIPs": [{"ip": address}],
                    "startTime": status.get("startTime") or container.started_at,
                    "containerStatuses": [
                        container_status(
                            first,
                            {"running": {"startedAt": container.started_at}},
                            ready=True,
                            container_id=container_id(process.pid),
                        )
                    ],
                }
            )
            set_conditions(status, ready=True)

        self.store.mutate("pods", meta.get("namespace"), meta["name"], running)

    def _wait(self, pod: Obj, waiting: _Waiting, reason: str, message: str) -> None:
        if (waiting.reason, waiting.message) == (reason, message):
            return
        waiting.reason, waiting.message = reason, message
        meta = pod["metadata"]
        first = pod["spec"]["containers"][0]
        host = self.address(pod["spec"].get("nodeName"))

        def pending(obj: Obj) -> None:
            status = obj.setdefault("status", {})
            status.update(
                {
                    "phase": "Pending",
                    "hostIP": host,
                    "hostIPs": [{"ip": host}],
                    "startTime": status.get("startTime") or semantics.timestamp(),
                    "containerStatuses": [
                        container_status(
                            first, {"waiting": {"reason": reason, "message": message}}, ready=False
                        )
                    ],
                }
            )
            set_conditions(
                status,
                ready=False,
                reason="ContainersNotReady",
                message=f"containers with unready status: [{first.get('name')}]",
            )

        self.store.mutate("pods", meta.get("namespace"), meta["name"], pending)

    def _fail(self, pod: Obj, reason: str, message: str, code: int) -> None:
        meta = pod["metadata"]
        first = pod["spec"]["containers"][0]
        stamp = semantics.timestamp()
        host = self.address(pod["spec"].get("nodeName"))

        def failed(obj: Obj) -> None:
            status = obj.setdefault("status", {})
            status.update(
                {
                    "phase": "Failed",
                    "hostIP": host,
                    "hostIPs": [{"ip": host}],
                    "startTime": status.get("startTime") or stamp,
                    "containerStatuses": [
                        container_status(
                            first,
                            {
                                "terminated": {
                                    "exitCode": code,
                                    "reason": reason,
                                    "message": message,
                                    "startedAt": stamp,
                                    "finishedAt": stamp,
                                }
                            },
                            ready=False,
                        )
                    ],
                }
            )
            set_conditions(status, ready=False, reason="PodFailed")

        self.store.mutate("pods", meta.get("namespace"), meta["name"], failed)

    def _report_exit(self, pod: Obj, container: Container) -> None:
        meta = pod["metadata"]
        first = pod["spec"]["containers"][0]
        code = container.exit_code or 0
        finished = semantics.timestamp()

        def exited(obj: Obj) -> None:
            status = obj.setdefault("status", {})
            status["phase"] = "Succeeded" if code == 0 else "Failed"
            status["containerStatuses"] = [
                container_status(
                    first,
                    {
                        "terminated": {
                            "exitCode": code,
                            "reason": "Completed" if code == 0 else "Error",
                            "startedAt": container.started_at,
                            "finishedAt": finished,
                            "containerID": container_id(container.process.pid),
                        }
                    },
                    ready=False,
                    container_id=container_id(container.process.pid),
                )
            ]
            set_conditions(status, ready=False, reason="PodCompleted" if code == 0 else "PodFailed")

        self.store.mutate("pods", meta.get("namespace"), meta["name"], exited)

    # -- environment --------------------------------------------------------------------------

    def _environment(self, pod: Obj, container: Obj) -> dict[str, str]:
        meta = pod["metadata"]
        namespace = str(meta.get("namespace"))
        env: dict[str, str] = {}
        for source in container.get("envFrom") or []:
            prefix = str(source.get("prefix") or "")
            if "secretRef" in source:
                ref = source["secretRef"]
                data = self._data("secrets", namespace, ref.get("name"), ref.get("optional"))
            elif "configMapRef" in source:
                ref = source["configMapRef"]
                data = self._data("configmaps", namespace, ref.get("name"), ref.get("optional"))
            else:
                continue
            for key, text in (data or {}).items():
                env[prefix + key] = text
        for var in container.get("env") or []:
            name = str(var["name"])
            if "value" in var:
                env[name] = expand(str(var.get("value") or ""), env)
                continue
            source = var.get("valueFrom") or {}
            value: str | None
            if "secretKeyRef" in source:
                value = self._key(pod, "secrets", "Secret", source["secretKeyRef"])
            elif "configMapKeyRef" in source:
                value = self._key(pod, "configmaps", "ConfigMap", source["configMapKeyRef"])
            elif "fieldRef" in source:
                address = self.address((pod.get("spec") or {}).get("nodeName"))
                value = field_value(pod, str(source["fieldRef"].get("fieldPath")), address)
            else:
                value = None
            if value is not None:
                env[name] = value
        return env

    def _data(self, plural: str, namespace: str, name: Any, optional: Any) -> dict[str, str] | None:
        obj = self.store.find(plural, namespace, str(name))
        if obj is None:
            if optional:
                return None
            kind = "secret" if plural == "secrets" else "configmap"
            raise ConfigError(f'{kind} "{name}" not found')
        if plural == "secrets":
            return {
                key: base64.b64decode(value).decode(errors="replace")
                for key, value in (obj.get("data") or {}).items()
            }
        return {key: str(value) for key, value in (obj.get("data") or {}).items()}

    def _key(self, pod: Obj, plural: str, kind: str, ref: Obj) -> str | None:
        namespace = str(pod["metadata"].get("namespace"))
        data = self._data(plural, namespace, ref.get("name"), ref.get("optional"))
        if data is None:
            return None
        key = str(ref.get("key"))
        if key not in data:
            if ref.get("optional"):
                return None
            raise ConfigError(f"couldn't find key {key} in {kind} {namespace}/{ref.get('name')}")
        return data[key]

    # -- processes ----------------------------------------------------------------------------

    @staticmethod
    def _kill_group(pgid: int, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)

    def kill_node(self, node: str) -> None:
        """A dead machine: SIGKILL every process group of the node's pods."""
        for container in self.containers.values():
            if container.node == node:
                self._kill_group(container.process.pid, signal.SIGKILL)

    def stop(self) -> None:
        """Kill every process group started, wait for each process, close the logs."""
        for container in self.containers.values():
            self._kill_group(container.process.pid, signal.SIGKILL)
        for uid in list(self.containers):
            container = self.containers[uid]
            with contextlib.suppress(subprocess.TimeoutExpired):
                container.process.wait(timeout=10)
            self._forget(uid)
        for process in self.orphans:
            self._kill_group(process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)
        self.orphans.clear()

    def pids(self, namespace: str, pod: str) -> list[int]:
        """The live (not zombie) processes of the pod's process group."""
        for container in self.containers.values():
            if (container.namespace, container.pod) == (namespace, pod):
                return group_members(container.process.pid)
        return []


def _find_program(program: str, cwd: str | None, path: str | None) -> None:
    """Raise ``FileNotFoundError`` (what ``Popen`` raises) when ``program`` cannot be run."""
    if "/" in program:
        found = Path(cwd or ".", program)
        if os.access(found, os.X_OK) and found.is_file():
            return
    elif shutil.which(program, path=path) is not None:
        return
    raise FileNotFoundError(2, "No such file or directory", program)
