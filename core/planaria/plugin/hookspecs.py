"""The hook specifications: every way a plugin can extend planaria.

A plugin is a module (or object) with functions marked ``@planaria.hookimpl`` whose names are
hooks below, registered in the entry-point group ``planaria``::

    [project.entry-points.planaria]
    mychip = "planaria_mychip.plugin"

Registration hooks (``planaria_<plural noun>``) return records; lifecycle hooks observe the job
and return nothing. Each implementation is called in isolation: one that raises is reported and
the others still run.
"""

from __future__ import annotations

from collections.abc import Iterable

from planaria.events import JobEvent
from planaria.fault_pattern.api import FaultPattern
from planaria.health.api import HealthCheckRecord
from planaria.node_benchmark.api import NodeBenchmarkRecord
from planaria.plugin import hookspec
from planaria.rendezvous.api import RendezvousRecord
from planaria.scheduler.api import SchedulerRecord
from planaria.storage.api import CheckpointStorageRecord


class PlanariaSpecs:
    @hookspec
    def planaria_health_checks(self) -> Iterable[HealthCheckRecord]:
        """Register health checks, selected by name in ``diagnosis.checks``.

        Example::

            @planaria.hookimpl
            def planaria_health_checks():
                yield HealthCheckRecord(
                    name="mychip", factory=MyChipCheck, options=MyChipOptions,
                    summary="MyChip accelerators: presence, ECC, temperature",
                )
        """
        raise NotImplementedError

    @hookspec
    def planaria_schedulers(self) -> Iterable[SchedulerRecord]:
        """Register schedulers, selected by ``scheduler.backend``.

        Example::

            @planaria.hookimpl
            def planaria_schedulers():
                yield SchedulerRecord(name="mycluster", factory=MyClusterScheduler,
                                      options=MyClusterOptions, summary="nodes on MyCluster")
        """
        raise NotImplementedError

    @hookspec
    def planaria_checkpoint_storages(self) -> Iterable[CheckpointStorageRecord]:
        """Register checkpoint storage targets, selected by ``checkpoint.storage.backend``.

        Example::

            @planaria.hookimpl
            def planaria_checkpoint_storages():
                yield CheckpointStorageRecord(name="mystore", factory=MyStore,
                                              options=MyStoreOptions, summary="objects on MyStore")
        """
        raise NotImplementedError

    @hookspec
    def planaria_node_benchmarks(self) -> Iterable[NodeBenchmarkRecord]:
        """Register node benchmarks for the pre-flight node check, selected by
        ``diagnosis.preflight_benchmark``. The core's ``cpu`` one times a torch matmul and a
        gloo allreduce; a chip vendor brings one for its device and collective library.

        Example::

            @planaria.hookimpl
            def planaria_node_benchmarks():
                yield NodeBenchmarkRecord(
                    name="mychip", factory=MyChipBenchmark, options=MyChipBenchOptions,
                    summary="MyChip GEMM and a MyCCL allreduce",
                )
        """
        raise NotImplementedError

    @hookspec
    def planaria_fault_patterns(self) -> Iterable[FaultPattern]:
        """Register log patterns that classify a failed worker (``node``, ``transient`` or
        ``user``), checked after the job's ``diagnosis.fault_patterns`` and before the
        core's vendor-neutral ones. A chip vendor knows its driver's messages; it tests them
        with :func:`planaria.fault_pattern.api.match`.

        Example::

            @planaria.hookimpl
            def planaria_fault_patterns():
                yield FaultPattern(pattern=r"MYCHIP-E(?:17|42)\b", kind="node",
                                   reason="MyChip HBM uncorrectable error")
        """
        raise NotImplementedError

    @hookspec
    def planaria_rendezvous(self) -> Iterable[RendezvousRecord]:
        """Register rank placements, selected by ``rendezvous.backend``: which member of a
        round gets which node rank (the master keeps membership, exclusion and fencing).
        The core's are ``stable`` (the default) and ``topology``; the contract is
        :mod:`planaria.rendezvous.api`'s, checked by
        :class:`planaria.testing.rendezvous.RendezvousConformance`.

        Example::

            @planaria.hookimpl
            def planaria_rendezvous():
                yield RendezvousRecord(name="byrack", factory=ByRack, options=ByRackOptions,
                                       summary="nodes of one rack get contiguous node ranks")
        """
        raise NotImplementedError

    @hookspec
    def planaria_job_event(self, event: JobEvent) -> None:
        """Observe the job: faults, restarts, replacements, committed checkpoints.

        Called once per event, in the master. Must return quickly (hand slow work such as a
        network call to a thread); an exception is logged and never affects the job.
        ``event.kind`` is an :class:`~planaria.events.EventKind` and ``event.payload`` that
        kind's model (fields: ``docs/events.md``); match kinds and fields, never
        ``event.message``, which is for people. The kinds: ``job_started``,
        ``job_finished``, ``job_stopped`` (``cause``), ``registration_refused``,
        ``master_stalled``; ``health_checked``, ``fault_detected``, ``hang_detected``,
        ``straggler_detected``, ``preflight_round``, ``preflight_completed``;
        ``workers_restarted`` (a new round: after a fault or to scale up), ``recovered``
        (training runs again after a fault), ``node_excluded``, ``node_replaced``,
        ``node_replacement_failed``, ``node_removed`` (stopped, none in its place),
        ``rendezvous_completed``; ``checkpoint_committed``, ``checkpoint_failed``,
        ``checkpoint_skipped``, ``started_from_scratch``, ``persister_restarted``. Example::

            @planaria.hookimpl
            def planaria_job_event(event):
                if event.kind is EventKind.NODE_REPLACEMENT_FAILED:
                    pager.send(f"{event.job}: nothing replaced {event.node}: "
                               f"{event.payload.error}; {event.payload.action}")
        """
