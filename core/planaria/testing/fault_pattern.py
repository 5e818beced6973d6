"""Helpers and a conformance suite for fault patterns (``planaria_fault_patterns`` records).

:func:`assert_classifies` and :func:`assert_unclassified` test patterns on one recorded log line
the way the classifier reads it. :class:`FaultPatternConformance` checks a plugin's patterns as
a whole: each compiles and says why it matched, the plugin's recorded samples classify as
documented, every pattern is exercised by a sample, and no pattern fires on the lines of a
healthy training log (:data:`ORDINARY_LOG_LINES`, plus the plugin's own ``ordinary_lines``),
where a false match would restart or replace a healthy node.

Example::

    class TestMyChipPatterns(FaultPatternConformance):
        plugin_name = "mychip"
        samples = [
            ("mychip0: fatal: MYCHIP-E42 on hbm3", "node"),
            ("MYCCL error: peer 3 closed the connection", "transient"),
        ]
        ordinary_lines = ["MYCCL INFO ring 0 built over 8 chips"]
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import ClassVar

import pytest

from planaria.fault_pattern.api import Classification, FaultClass, FaultKind, FaultPattern, match
from planaria.plugin.manager import PluginManager, PluginStatus

ORDINARY_LOG_LINES: tuple[str, ...] = (
    "step 1200/50000 | loss 2.0131 | lr 2.4e-04 | grad_norm 0.91 | 152.3 ms/step | 183211 tok/s",
    "Epoch 3:  42%|████▏     | 210/500 [01:03<01:27,  3.31it/s, loss=0.512, v_num=0]",
    "[rank0]: eval at step 1200: val_loss 2.1044, perplexity 8.20",
    "INFO:root:saved checkpoint step-1200 (4.2 GiB) in 0.38 s",
    "Restored 1,234,567,890 parameters from step-1200; resuming at step 1201",
    "torch.distributed: initialized process group backend=nccl rank=3 world_size=16",
    "INFO:torch.distributed.elastic.agent.server.api:[default] Starting worker group",
    "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid "
    "your system being overloaded, please further tune the variable for optimal performance in "
    "your application as needed.",
    "[W reducer.cpp:1389] Warning: find_unused_parameters=True was specified in DDP constructor, "
    "but did not find any unused parameters in the forward pass.",
    "UserWarning: TypedStorage is deprecated. It will be removed in the future and UntypedStorage "
    "will be the only storage class.",
    "node-3:48211:48211 [0] NCCL INFO Bootstrap : Using eth0:10.0.0.3<0>",
    "node-3:48211:48211 [0] NCCL INFO cudaDriverVersion 12040",
    "node-3:48211:48390 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB ; OOB eth0:10.0.0.3<0>",
    "node-3:48211:48390 [0] NCCL INFO Channel 00/24 :    0   1   2   3   4   5   6   7",
    "node-3:48211:48390 [0] NCCL INFO comm 0x55d2c8e0 rank 0 nranks 16 cudaDev 0 busId 3b000 - "
    "Init COMPLETE",
    "max_memory_allocated 61.2 GiB, max_memory_reserved 70.4 GiB",
    "Using a timeout of 1800 s for collectives (NCCL_TIMEOUT); error handling: async",
    "data loader: 8 workers, prefetch_factor 2, pin_memory True",
)
"""Lines of healthy training logs (PyTorch, DDP, NCCL's INFO lines): no pattern may match them."""


def assert_classifies(
    patterns: FaultPattern | Iterable[FaultPattern],
    line: str,
    kind: FaultKind | FaultClass,
    reason: str | None = None,
) -> Classification:
    """Assert that ``line`` (a log line or tail) classifies as ``kind``, its reason holding
    ``reason`` when given, exactly as the classifier would decide; return the verdict."""
    verdict = match(patterns, line)
    assert verdict is not None, f"no pattern matches {line!r}"
    expected = FaultClass(kind)
    assert verdict.kind is expected, (
        f"{line!r} classifies as {verdict.kind.value} ({verdict.reason}), expected {expected.value}"
    )
    if reason is not None:
        assert reason in verdict.reason, f"{line!r}: reason {verdict.reason!r} lacks {reason!r}"
    return verdict


def assert_unclassified(patterns: FaultPattern | Iterable[FaultPattern], line: str) -> None:
    """Assert that no pattern matches ``line``."""
    verdict = match(patterns, line)
    assert verdict is None, f"{line!r} matched {verdict.kind.value} ({verdict.reason})"


class FaultPatternConformance:
    """Tests every plugin's fault patterns must pass; see the module docstring."""

    plugin_name: ClassVar[str | None] = None
    """The installed plugin's entry-point name: the default ``patterns`` fixture reads its
    patterns as the classifier gets them."""
    samples: ClassVar[Sequence[tuple[str, FaultKind]]] = ()
    """Recorded log lines and the class each must get, as the plugin documents them."""
    ordinary_lines: ClassVar[Sequence[str]] = ()
    """Healthy lines of this vendor's logs, on top of :data:`ORDINARY_LOG_LINES`."""
    every_pattern_sampled: ClassVar[bool] = True
    """Each pattern is the first match of at least one sample: none is dead or shadowed."""

    @pytest.fixture
    def patterns(self) -> list[FaultPattern]:
        if self.plugin_name is None:
            pytest.fail(
                "a FaultPatternConformance subclass must set plugin_name (its entry point's "
                "name) or define a `patterns` fixture"
            )
        manager = PluginManager.from_entry_points()
        registered = manager.fault_patterns()
        info = manager.plugins.get(self.plugin_name)
        assert info is not None, f"no installed plugin is named {self.plugin_name!r}"
        assert info.status is PluginStatus.LOADED, f"{self.plugin_name}: {info.reason}"
        return [p for name, p in registered if name == self.plugin_name]

    def test_each_pattern_compiles_and_says_why(self, patterns: list[FaultPattern]) -> None:
        assert patterns, "the plugin registers no fault pattern"
        for pattern in patterns:
            assert isinstance(pattern, FaultPattern), f"{pattern!r} is not a FaultPattern"
            re.compile(pattern.pattern, re.MULTILINE)
            assert pattern.reason.strip(), f"{pattern.pattern!r} needs a reason (the timeline's)"
            assert "\n" not in pattern.reason
            # A pattern that matches nothing specific would classify every failed worker.
            assert match(pattern, "") is None, f"{pattern.pattern!r} matches an empty log"

    def test_samples_classify_as_documented(self, patterns: list[FaultPattern]) -> None:
        if not self.samples:
            pytest.fail("list the plugin's recorded log lines and their classes in `samples`")
        wrong = []
        for line, kind in self.samples:
            verdict = match(patterns, line)
            if verdict is None or verdict.kind is not FaultClass(kind):
                got = "nothing" if verdict is None else f"{verdict.kind.value} ({verdict.reason})"
                wrong.append(f"{line!r}: expected {kind}, got {got}")
        assert not wrong, "\n".join(wrong)

    def test_every_pattern_is_the_verdict_of_a_sample(self, patterns: list[FaultPattern]) -> None:
        if not self.every_pattern_sampled:
            pytest.skip("every_pattern_sampled = False")
        decided = set()
        for line, _ in self.samples:
            for index, pattern in enumerate(patterns):
                if match(pattern, line) is not None:
                    decided.add(index)
                    break
        unsampled = [p.pattern for i, p in enumerate(patterns) if i not in decided]
        assert not unsampled, (
            "patterns no sample reaches (add a recorded line for each, or it never decides): "
            + ", ".join(map(repr, unsampled))
        )

    def test_a_healthy_log_is_no_fault(self, patterns: list[FaultPattern]) -> None:
        lines = [*ORDINARY_LOG_LINES, *self.ordinary_lines]
        matched = [
            f"{line!r} matched {verdict.kind.value} ({verdict.reason})"
            for line in lines
            if (verdict := match(patterns, line)) is not None
        ]
        assert not matched, "\n".join(matched)
        # As one log tail, the way the classifier reads a failed worker's log.
        assert match(patterns, "\n".join(lines)) is None
