"""Unquoted YAML values read as YAML 1.2 reads them (``nodes: 4:8`` is a range, not the base-60
number 248), and a problem of a ``--set`` value names the ``--set``, not a line of the file."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from planaria.config import load
from planaria.config.loader import parse_text
from planaria.errors import ConfigError

FILE = "job:\n  name: demo\n  nodes: {nodes}\nscheduler:\n  options: {{max_nodes: 16}}\n"


def write(tmp_path: Path, text: str, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def problems(path: Path, overrides: list[str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as exc:
        load(path, overrides)
    return [str(issue) for issue in exc.value.issues]


@pytest.mark.parametrize(
    ("text", "overrides"),
    [
        (FILE.format(nodes="4:8"), []),
        (FILE.format(nodes='"4:8"'), []),
        (FILE.format(nodes="'4:8'"), []),
        (FILE.format(nodes="2"), ["job.nodes=4:8"]),
        (FILE.format(nodes="2"), ['job.nodes="4:8"']),
        ("", ["job.nodes=4:8"]),
    ],
    ids=["unquoted", "double-quoted", "single-quoted", "set", "set-quoted", "set-no-file-key"],
)
def test_every_spelling_of_a_node_range_means_that_range(tmp_path, text, overrides):
    resolved, _ = load(write(tmp_path, text), overrides)
    assert (resolved.config.job.nodes.min, resolved.config.job.nodes.max) == (4, 8)
    assert resolved.dump()["job"]["nodes"] == "4:8"


def test_a_node_range_in_toml(tmp_path):
    resolved, _ = load(write(tmp_path, '[job]\nnodes = "4:8"\n', "job.toml"))
    assert (resolved.config.job.nodes.min, resolved.config.job.nodes.max) == (4, 8)


def test_a_bad_range_in_the_file_names_its_line(tmp_path):
    path = write(tmp_path, FILE.format(nodes="8:4"))
    assert problems(path) == ["job.nodes (line 3): min (8) is greater than max (4)"]


def test_a_bad_range_given_by_set_names_the_set_and_no_line(tmp_path):
    path = write(tmp_path, FILE.format(nodes="2"))
    assert problems(path, ["job.nodes=8:4"]) == [
        "job.nodes (--set job.nodes=8:4): min (8) is greater than max (4)"
    ]


def test_what_a_scheduler_refuses_in_a_set_value_names_the_set(tmp_path):
    # The local scheduler's own limit (max_nodes: 16), found after validation.
    path = write(tmp_path, FILE.format(nodes="2"))
    (found,) = problems(path, ["job.nodes=2:40"])
    assert found.startswith("job.nodes (--set job.nodes=2:40): 40 nodes are more than"), found


def test_a_set_of_a_whole_section_replaces_the_file_s_lines_below_it(tmp_path):
    path = write(tmp_path, FILE.format(nodes="2"))
    (found,) = problems(path, ["job={nodes: 8:4}"])
    assert found == "job.nodes (--set job={nodes: 8:4}): min (8) is greater than max (4)"


def test_a_later_set_wins_over_an_earlier_one_below_it(tmp_path):
    path = write(tmp_path, FILE.format(nodes="2"))
    (found,) = problems(path, ["job.nodes=8:4", "job={nodes: 9:5}"])
    assert found == "job.nodes (--set job={nodes: 9:5}): min (9) is greater than max (5)"


@pytest.mark.parametrize(
    ("line", "path", "expected"),
    [
        ("job: {name: on}", ("job", "name"), "on"),
        ("job: {name: no}", ("job", "name"), "no"),
        ("job: {name: 2024-06-01}", ("job", "name"), "2024-06-01"),
        ("job: {name: 0755}", ("job", "name"), "0755"),
        (
            "job: {env: {DEBUG: yes, MODE: off, AT: 1:30}}",
            ("job", "env"),
            {"DEBUG": "yes", "MODE": "off", "AT": "1:30"},
        ),
        ("job: {procs_per_node: 010}", ("job", "procs_per_node"), 10),
        ("job: {max_restarts: 1_000}", ("job", "max_restarts"), 1000),
        ("diagnosis: {preflight: yes, checks: []}", ("diagnosis", "preflight"), True),
        ("diagnosis: {preflight: off, checks: []}", ("diagnosis", "preflight"), False),
        ("diagnosis: {preflight: TRUE, checks: []}", ("diagnosis", "preflight"), True),
        ("master: {tls: null}", ("master", "tls"), None),
        ("diagnosis: {straggler_factor: 1.5e+0}", ("diagnosis", "straggler_factor"), 1.5),
    ],
)
def test_yaml_1_1_surprises_are_read_as_written(tmp_path, line, path, expected):
    resolved, _ = load(write(tmp_path, line + "\n"))
    value: object = resolved.config
    for part in path:
        value = getattr(value, part)
    assert value == expected


def test_a_clock_time_as_a_duration_asks_for_units(tmp_path):
    path = write(tmp_path, "job:\n  stop_grace: 1:30\n")
    (found,) = problems(path)
    assert found.startswith("job.stop_grace (line 2): invalid duration '1:30': minutes:seconds")
    assert "1m30s or 1h30m" in found


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("4:8", "4:8"),
        ("190:20:30", "190:20:30"),
        ("1:30.5", "1:30.5"),
        ("on", "on"),
        ("Yes", "Yes"),
        ("2024-06-01", "2024-06-01"),
        ("0o17", "0o17"),
        ("017", "017"),
        ("=", "="),
        ("1e3", "1e3"),
        ("true", True),
        ("~", None),
        ("", None),
        ("0x1F", 31),
        ("-12", -12),
        ("1.5", 1.5),
        (".inf", math.inf),
    ],
)
def test_plain_scalars(text, value):
    assert parse_text(f"v: {text}\n", "<test>").data == {"v": value}


_VALUES = st.one_of(
    st.text(),
    st.integers(),
    st.floats(allow_nan=False),
    st.booleans(),
    st.none(),
    st.from_regex(r"\A[-+]?[0-9_:.eExXoObB]{1,12}\Z"),  # what looks like a number
    st.sampled_from(["on", "off", "yes", "no", "y", "n", "Null", "2024-06-01", "<<", "="]),
)


@given(st.dictionaries(st.text(min_size=1), _VALUES, max_size=5))
def test_what_yaml_safe_dump_writes_reads_back_unchanged(data):
    """Other tools write config files with PyYAML (YAML 1.1), which quotes only what YAML 1.1
    would misread: every value read as a non-string here must be read the same there."""
    assert parse_text(yaml.safe_dump({"v": data}), "<test>").data == {"v": data}
