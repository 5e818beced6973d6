"""The built-in rank placements, ``stable`` and ``topology``, pass the rendezvous suite."""

from __future__ import annotations

from planaria.testing import RendezvousConformance


class TestStable(RendezvousConformance):
    placement_name = "stable"


class TestTopology(RendezvousConformance):
    placement_name = "topology"


class TestTopologyByRack(RendezvousConformance):
    placement_name = "topology"
    placement_options = {"label": "rack"}
