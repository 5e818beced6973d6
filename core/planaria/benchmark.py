"""The old home of the node benchmark interface, now :mod:`planaria.node_benchmark.api`: kept
for plugins written against it, each name warned where it lives now."""

from __future__ import annotations

from planaria.moved import forward

_MOVED = {
    "planaria.node_benchmark.api": (
        "BenchmarkContext",
        "BenchmarkResult",
        "Clock",
        "NodeBenchmark",
    ),
}


def __getattr__(name: str) -> object:
    return forward(__name__, _MOVED, name)
