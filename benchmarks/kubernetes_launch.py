"""How long the ``kubernetes`` scheduler takes to create a large job's pods: ``parallelism``
at once against one at a time, in the same run.

The API server is the emulated one (:class:`planaria_kubernetes.testing.EmulatedCluster`, in
a process of its own so that it does not share this one's interpreter lock), with no nodes:
the pods stay pending, so what is measured is the API round trips of creating them (the
client's serialisation, HTTP, the server's store and watch fan-out), not a kubelet's work.
Each pod is created exactly as a launch creates it (:meth:`KubernetesScheduler._create`),
then the whole set is deleted again.

    python benchmarks/kubernetes_launch.py [--pods 1000] [--parallelism 32]

Last line: ``{"pods": N, "serial_s": ..., "parallel_s": ..., "parallelism": P,
"speedup": ...}``. A real API server answers a pod creation in a few milliseconds, with
admission webhooks in tens: the serial time grows with that latency, the parallel one far less.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
import time
import uuid
from typing import Any

from planaria import log
from planaria.scheduler.api import LaunchSpec
from planaria.scheduler.engine import EngineNode
from planaria_kubernetes import KubernetesOptions, KubernetesScheduler

SERVER = textwrap.dedent(
    """
    import sys
    from planaria_kubernetes.testing import EmulatedCluster
    with EmulatedCluster(nodes=()) as cluster:
        print(cluster.kubeconfig, cluster.namespace, flush=True)
        sys.stdin.read()
    """
)


def create(kubeconfig: str, namespace: str, pods: int, parallelism: int) -> float:
    options = KubernetesOptions(
        image="planaria-bench:1",
        kubeconfig=kubeconfig,
        namespace=namespace,
        parallelism=parallelism,
        stop_grace=1,
    )
    scheduler = KubernetesScheduler(options)
    run = f"bench-{uuid.uuid4().hex[:6]}"
    spec = LaunchSpec(job="bench", command=("python", "-m", "planaria", "agent"), run_id=run)
    scheduler._connect(spec)
    scheduler._ensure_secret(spec)
    nodes = []
    for number in range(pods):  # the engine's table, as a launch fills it before the pods
        node: EngineNode[Any] = EngineNode(f"node-{number}", spec)
        node.data = scheduler.start(node)
        scheduler.nodes[node.node_id] = node
        nodes.append(node)
    started = time.perf_counter()
    scheduler._create(nodes)
    took = time.perf_counter() - started
    scheduler.stop()
    return took


def main() -> None:
    log.configure("console", "warning")  # one line per pod otherwise
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=1000)
    parser.add_argument("--parallelism", type=int, default=32)
    args = parser.parse_args()
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        kubeconfig, namespace = server.stdout.readline().split()
        create(kubeconfig, namespace, 20, args.parallelism)  # warm both sides up
        serial = create(kubeconfig, namespace, args.pods, 1)
        parallel = create(kubeconfig, namespace, args.pods, args.parallelism)
    finally:
        assert server.stdin is not None
        server.stdin.close()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:  # what was measured stands; the server must not stay
            print("the emulated API server did not stop within 60 s: killed", file=sys.stderr)
            server.kill()
            server.wait()
    print(f"creating {args.pods} pods one at a time:  {serial:7.2f} s")
    print(f"creating {args.pods} pods {args.parallelism} at a time: {parallel:7.2f} s")
    print(f"speedup: {serial / parallel:.1f}x")
    result = {
        "pods": args.pods,
        "serial_s": round(serial, 3),
        "parallel_s": round(parallel, 3),
        "parallelism": args.parallelism,
        "speedup": round(serial / parallel, 2),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
