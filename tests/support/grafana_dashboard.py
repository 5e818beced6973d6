"""``docs/grafana.json``, read for its tests: its queries and the metric names they ask for,
and the names a scrape serves."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana.json"
METRIC = re.compile(r"\bplanaria_[a-z0-9_]+\b")
SERIES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
"""The series names of a family of each type, as the text format writes them."""


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def queries(board: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) of every query: each panel's targets, the variables', the annotations'."""
    found = [
        (f"panel {p['title']!r} target {t['refId']}", t["expr"])
        for p in board["panels"]
        for t in p.get("targets", [])
    ]
    found += [
        (f"variable {v['name']!r}", v["query"]["query"])
        for v in board["templating"]["list"]
        if v["type"] == "query"
    ]
    found += [
        (f"annotation {a['name']!r}", a["expr"])
        for a in board["annotations"]["list"]
        if "expr" in a
    ]
    return found


def asked(board: dict[str, Any]) -> dict[str, str]:
    """Every metric name the dashboard's queries ask for, and the first query that does."""
    names: dict[str, str] = {}
    for where, expr in queries(board):
        for name in METRIC.findall(expr):
            names.setdefault(name, where)
    return names


def served(exposition: str) -> set[str]:
    """The series names a scrape serves: a family's even when it has no sample yet (a counter
    by label before its first event), as its type names them."""
    names = set()
    for family in text_string_to_metric_families(exposition):
        names |= {family.name + suffix for suffix in SERIES.get(family.type, ("",))}
        names |= {sample.name for sample in family.samples}
    return names
