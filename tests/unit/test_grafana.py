"""``docs/grafana.json`` is a dashboard Grafana imports: its panels query the Prometheus data
source chosen by its ``datasource`` variable, and every query is PromQL that Prometheus parses
(promtool's check where Debian's ``prometheus`` is installed). That it asks only for metrics the
master serves is checked against a real job's scrapes in ``test_metrics.py``."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import yaml

from support.grafana_dashboard import dashboard, queries

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
GRID_WIDTH = 24


def test_the_dashboard_is_a_grafana_dashboard_with_a_prometheus_variable():
    board = dashboard()
    assert board["schemaVersion"] >= 36 and board["uid"] and board["title"]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["instance"]["datasource"] == DATASOURCE
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    graphs = [p for p in board["panels"] if p["type"] != "row"]
    assert len(graphs) >= 15
    for panel in graphs:
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, panel["title"]
            assert target["expr"].strip(), panel["title"]
        grid = panel["gridPos"]
        assert grid["w"] > 0 and grid["h"] > 0 and grid["x"] + grid["w"] <= GRID_WIDTH


def test_no_two_panels_overlap():
    cells: dict[tuple[int, int], str] = {}
    for panel in dashboard()["panels"]:
        grid = panel["gridPos"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = panel["title"]


def test_every_query_selects_the_chosen_masters():
    """Each series a query reads is narrowed to the masters the ``instance`` variable chose,
    so that the dashboard of one job does not add another's figures."""
    for where, expr in queries(dashboard()):
        if where.startswith("variable"):
            continue
        for selector in re.findall(r"\bplanaria_[a-z0-9_]+(\{[^}]*\})?", expr):
            assert 'instance=~"$instance"' in selector, f"{where}: {expr}"


def test_promtool_parses_every_query(tmp_path):
    """Each query, its Grafana variables given values, is a recording rule promtool accepts."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian package prometheus): PromQL not parsed")
    rules = []
    for number, (_, expr) in enumerate(queries(dashboard())):
        if expr.startswith("label_values("):
            continue  # Grafana's own function, not PromQL
        expr = expr.replace("$__rate_interval", "1m").replace("$__range", "1h")
        rules.append({"record": f"planaria:dashboard_query_{number}", "expr": expr})
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    checked = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
