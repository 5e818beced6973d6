"""The built-in ``cpu`` benchmark passes the node-benchmark conformance suite."""

from __future__ import annotations

from typing import Any

import pytest

from planaria.testing import NodeBenchmarkConformance


class TestCpuBenchmark(NodeBenchmarkConformance):
    benchmark_name = "cpu"

    @pytest.fixture
    def benchmark_options(self) -> dict[str, Any]:
        return {"size": 64, "repeats": 3, "allreduce_numel": 1024}
