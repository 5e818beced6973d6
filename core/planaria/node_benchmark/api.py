"""The node-benchmark interface: what the pre-flight node check runs on every node.

A benchmark times the node's compute and its collective library in a small group of nodes
(two, three when the count is odd, or one). It runs in a child process of the agent, one process
per node of the group, and must finish within ``context.timeout`` seconds: the agent kills it
after that, and the master counts a timeout. The group is in the :class:`BenchmarkContext`
only: the child's environment is the agent's, unchanged, with no ``MASTER_ADDR``,
``MASTER_PORT``, ``RANK`` or ``WORLD_SIZE`` set for the group (one there came from whatever
started the agent). Pass the context's values to your library (``init_method="tcp://..."``),
or set them in ``os.environ`` first for an ``env://`` init, as the built-in ``cpu`` benchmark
does.

A benchmark returns *measures*: named durations in seconds, lower is better, comparable across
nodes. The master compares each with the median of the other nodes' (in round 2, of the nodes
found good); a node above ``diagnosis.preflight_factor`` times it is a suspect (see
:mod:`planaria.diagnosis.preflight`).
Put there only what tells a slow node from a fast one; anything else goes in ``info``.
"""

from __future__ import annotations

import statistics
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from planaria.chaos import burn
from planaria.plugin.records import PluginKind, PluginRecord

OptionsT = TypeVar("OptionsT", bound=BaseModel)

Clock = Literal["thread", "process", "wall"]
_CLOCKS: dict[str, Callable[[], float]] = {
    "thread": time.thread_time,
    "process": time.process_time,
    "wall": time.perf_counter,
}


class BenchmarkResult(BaseModel):
    """``BenchmarkResult(measures={"matmul": 0.012}, info={"allreduce_s": 0.003})``"""

    model_config = ConfigDict(frozen=True, extra="forbid")

    measures: dict[str, float] = Field(
        default_factory=dict,
        description="seconds, lower is better: judged against the other nodes' median",
    )
    info: dict[str, float | int | str] = Field(
        default_factory=dict, description="reported as is, never judged"
    )


@dataclass(frozen=True)
class BenchmarkContext:
    """The group a benchmark runs in, and the time it has: the only place that says so (the
    process's environment holds no torch.distributed variables for the group)."""

    node_id: str
    host: str
    rank: int
    """This node's rank in the group (0 is the group's leader, at ``master_addr``)."""
    world_size: int
    master_addr: str
    master_port: int
    timeout: float
    slow_factor: float = 1.0
    """Fault injection (``slow_node``): :meth:`timed` makes this node that much slower."""

    def timed(
        self,
        fn: Callable[[], object],
        repeats: int,
        *,
        clock: Clock = "thread",
        warmup: int = 1,
    ) -> float:
        """The median over ``repeats`` timings of ``fn()``, after ``warmup`` untimed calls.

        ``clock``: ``thread`` (CPU time of this thread: a slower processor takes longer, a
        neighbour's load does not count), ``process`` (CPU time of every thread of the
        process) or ``wall``. A ``slow_node`` fault burns ``factor - 1`` times each call's own
        time inside the timed span, as a slower processor would; benchmarks that time their
        compute through this helper get fault injection for free.
        """
        if repeats < 1:
            raise ValueError(f"repeats must be at least 1, got {repeats}")
        now = _CLOCKS[clock]
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeats):
            start = now()
            fn()
            if self.slow_factor > 1.0:
                burn((self.slow_factor - 1.0) * (now() - start))
            times.append(now() - start)
        return statistics.median(times)


class NodeBenchmark(ABC, Generic[OptionsT]):
    """Base class of every node benchmark::

    class MyChipBenchmark(NodeBenchmark[MyChipOptions]):
        def run(self, context):
            ...  # init_process_group("mychip-ccl"), time a matmul and an allreduce
            return BenchmarkResult(measures={"matmul": m, "allreduce": a})
    """

    name: ClassVar[str] = ""

    def __init__(self, options: OptionsT) -> None:
        self.options = options

    @abstractmethod
    def run(self, context: BenchmarkContext) -> BenchmarkResult:
        """Run once in this node's group; raise when the node cannot do its part."""


class NodeBenchmarkRecord(PluginRecord):
    """``NodeBenchmarkRecord(name="cpu", factory=CpuBenchmark, options=CpuOptions, summary=...)``"""

    kind: ClassVar[PluginKind] = PluginKind.NODE_BENCHMARK
    factory: type[NodeBenchmark]  # type: ignore[type-arg]  # pydantic rejects type[X[Any]]
