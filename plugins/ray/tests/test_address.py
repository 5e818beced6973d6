"""Where a master bound to every interface looks for the Ray cluster's network: the head node's
host, as the config names it (Ray itself is not asked)."""

from __future__ import annotations

import pytest

from planaria_ray import RayOptions, RayScheduler


@pytest.mark.parametrize(
    ("address", "env", "hosts"),
    [
        (None, {}, ["127.0.0.1"]),
        ("10.0.0.1:6379", {}, ["10.0.0.1"]),
        ("ray://head.cluster:10001", {}, ["head.cluster"]),
        ("[fd00::1]:6379", {}, ["fd00::1"]),
        ("auto", {"RAY_ADDRESS": "10.0.0.9:6379"}, ["10.0.0.9"]),
    ],
)
def test_the_head_node_s_host(address, env, hosts, monkeypatch) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert RayScheduler(RayOptions(address=address)).node_addresses() == hosts
