"""The declarative config: parsing, every kind of bad input, overrides, resolution, schema."""

from __future__ import annotations

import json

import jsonschema
import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from planaria.config import load
from planaria.config.job import NodeRange
from planaria.config.loader import parse_text
from planaria.config.schema import config_schema
from planaria.durations import format_duration, parse_duration
from planaria.errors import ConfigError
from planaria.health.host import HostOptions
from planaria.plugin.manager import PluginManager
from planaria.rendezvous.builtin import StablePlacement, TopologyOptions
from planaria.storage.local import LocalStorage
from support.cli import problems, write

GOOD = """\
job:
  name: gpt-demo
  command: python train.py --steps 100
  nodes: "2:4"
  procs_per_node: 2
  node_unit: 2
diagnosis:
  preflight: true
  hang_timeout: 2m
  checks:
    - host
    - backend: host
      name: scratch
      timeout: 500ms
      options: {min_free_disk: 1MiB, paths: [/tmp]}
logging: {format: json, level: DEBUG}
"""


def test_good_yaml_resolves_with_defaults(tmp_path):
    resolved, _ = load(write(tmp_path, GOOD))
    job = resolved.config.job
    assert job.command == ["python", "train.py", "--steps", "100"]
    assert (job.nodes.min, job.nodes.max, job.procs_per_node) == (2, 4, 2)
    assert resolved.config.diagnosis.hang_timeout == 120.0
    assert [c.name for c in resolved.checks] == ["host", "scratch"]
    scratch = resolved.checks[1]
    assert scratch.timeout == 0.5
    assert isinstance(scratch.options, HostOptions)
    assert scratch.options.min_free_disk == 1 << 20
    assert resolved.config.logging.level == "debug"
    dumped = resolved.dump()
    assert dumped["job"]["nodes"] == "2:4"
    assert dumped["diagnosis"]["checks"][0]["options"]["min_shm"] == 64 << 20
    assert dumped["diagnosis"]["hang_timeout"] == "2m"


def test_show_output_validates_again_to_the_same_config(tmp_path):
    resolved, _ = load(write(tmp_path, GOOD))
    again, _ = load(write(tmp_path, yaml.safe_dump(resolved.dump()), "shown.yaml"))
    assert again.dump() == resolved.dump()


def test_toml_is_read_like_yaml(tmp_path):
    toml = """
[job]
name = "gpt-demo"
nodes = "2:4"

[[diagnosis.checks]]
backend = "host"
timeout = "30s"
[diagnosis.checks.options]
min_shm = "1MiB"
"""
    resolved, _ = load(write(tmp_path, toml, "job.toml"))
    assert resolved.config.job.nodes.max == 4
    assert resolved.checks[0].timeout == 30.0
    assert resolved.checks[0].options.min_shm == 1 << 20


def test_defaults_only(tmp_path):
    resolved, _ = load(None)
    assert [c.name for c in resolved.checks] == ["host"]
    # Built-in defaults resolve, the default storage included.
    assert resolved.backends["scheduler"].record.name == "local"
    rendezvous = resolved.backends["rendezvous"]  # the master places ranks as it always did
    assert rendezvous.record.name == "stable"
    assert rendezvous.record.factory is StablePlacement
    storage = resolved.backends["checkpoint.storage"]
    assert storage.record.name == "local"
    assert storage.record.factory is LocalStorage


BAD = [
    ("job: {nodes: '4:2'}", "job.nodes", "min (4) is greater than max (2)"),
    ("master: {advertise: 0.0.0.0}", "master.advertise", "no address an agent can connect to"),
    (
        "master: {advertise: 'https://login1:29400'}",
        "master.advertise",
        "neither an IP address nor a host name (no scheme, port",
    ),
    ("master: {advertise: 'login 1'}", "master.advertise", "neither an IP address nor a host"),
    ("job: {nodes: two}", "job.nodes", "invalid node count 'two'"),
    ("job: {nodes: 0}", "job.nodes.min", "greater than or equal to 1"),
    ("job: {procs_per_nod: 2}", "job.procs_per_nod", "did you mean 'procs_per_node'"),
    ("job: {max_restarts: -1}", "job.max_restarts", "greater than or equal to 0"),
    ("job: {name: 'bad name!'}", "job.name", "should match pattern"),
    ("job: {nodes: 2, node_unit: 3}", "job", "node_unit (3) is larger"),
    ("job: {standby: -1}", "job.standby", "greater than or equal to 0"),
    ("job: {nodes: 100000, standby: 1}", "job", "100000 nodes and 1 standing by are more than"),
    (
        "job: {nodes: 2, standby: 1}\nscheduler: {options: {max_nodes: 2}}\n",
        "job.nodes",
        "3 nodes are more than the local scheduler",
    ),
    ("checkpoint: {replica: {every: 0}}", "checkpoint.replica.every", "greater than or equal to 1"),
    (
        "checkpoint: {replica: {max_mb_per_second: 0}}",
        "checkpoint.replica.max_mb_per_second",
        "greater than 0",
    ),
    ("checkpoint: {replica: {evry: 2}}", "checkpoint.replica.evry", "did you mean 'every'"),
    ("job: {command: 'python \"unclosed'}", "job.command", "cannot split command"),
    ("job: {command: 5}", "job.command", "valid list"),
    ("jobs: {}", "jobs", "did you mean 'job'"),
    ("diagnosis: {checks: [nosuch]}", "diagnosis.checks[0].backend", "Choose one of: "),
    (
        "diagnosis: {crash_loop_rounds: -1}",
        "diagnosis.crash_loop_rounds",
        "greater than or equal to 0",
    ),
    ("diagnosis: {crash_loop_rounds: twice}", "diagnosis.crash_loop_rounds", "valid integer"),
    (
        "diagnosis: {checks: [{backend: host, timeout: abc}]}",
        "diagnosis.checks[0].timeout",
        "invalid duration 'abc'",
    ),
    (
        "diagnosis: {checks: [{backend: host, timeout: -5s}]}",
        "diagnosis.checks[0].timeout",
        "invalid duration",
    ),
    (
        "diagnosis: {checks: [{backend: host, timeout: 0}]}",
        "diagnosis.checks[0].timeout",
        "must be positive",
    ),
    (
        "diagnosis: {checks: [{backend: host, options: {min_shm: lots}}]}",
        "diagnosis.checks[0].options.min_shm",
        "could not parse",
    ),
    (
        "diagnosis: {checks: [{backend: host, options: {pathz: [/tmp]}}]}",
        "diagnosis.checks[0].options.pathz",
        "did you mean 'paths'",
    ),
    (
        "diagnosis: {checks: [{backend: host, options: [1]}]}",
        "diagnosis.checks[0].options",
        "expected a mapping of options",
    ),
    ("diagnosis: {checks: [{options: {}}]}", "diagnosis.checks[0].backend", "required"),
    ("diagnosis: {checks: [host, host]}", "diagnosis", "both named 'host'"),
    ("diagnosis: {preflight: maybe}", "diagnosis.preflight", "valid boolean"),
    ("diagnosis: {straggler_factor: 0.5}", "diagnosis.straggler_factor", "greater than 1"),
    (
        "scheduler: {backend: slurm}",
        "scheduler.backend",
        "not installed. Choose one of: external, local",
    ),
    (
        "checkpoint: {storage: {backend: fsspec}}",
        "checkpoint.storage.backend",
        "pip install planaria-fsspec",
    ),
    ("rendezvous: {join_grace: soon}", "rendezvous.join_grace", "invalid duration"),
    ("rendezvous: {store: rank1}", "rendezvous.store", "'rank0' or 'master'"),
    (
        "rendezvous: {backend: etcd}",
        "rendezvous.backend",
        "rendezvous 'etcd' is not installed. Choose one of: stable, topology",
    ),
    (
        "rendezvous: {backend: topology, options: {lable: rack}}",
        "rendezvous.options.lable",
        "did you mean 'label'",
    ),
    (
        "scheduler: {backend: local, options: {topology: {node-0: {switch: s1}}}}",
        "scheduler.options.topology",
        "topology keys are the local scheduler's host names, local-0, local-1",
    ),
    ("checkpoint: {keep_last: 0}", "checkpoint.keep_last", "greater than or equal to 1"),
    ("plugins: {disable: host}", "plugins.disable", "valid list"),
    ("logging: {format: xml}", "logging.format", "'console' or 'json'"),
    ("logging: {level: loud}", "logging.level", "'debug', 'info', 'warning' or 'error'"),
    ("- just\n- a list\n", "<top level>", "must hold a mapping of sections"),
    ("job: [1\n", "<top level>", "not valid YAML"),
    ("job: {name: a}\njob: {name: b}\n", "job", "key given twice (lines 1 and 2)"),
    ("{}: 1\n", "<top level> (line 1)", "a key must be a name, not a mapping"),
    ("job:\n  ? [a, b]\n  : 1\n", "<top level> (line 2)", "a key must be a name, not a list"),
]


@pytest.mark.parametrize(("text", "path", "fragment"), BAD, ids=[b[1] + ":" + b[2] for b in BAD])
def test_bad_config_names_the_path_and_the_problem(tmp_path, text, path, fragment):
    found = problems(tmp_path, text)
    assert any(p.startswith(path) and fragment in p for p in found), found


def test_every_problem_is_reported_together_with_lines(tmp_path):
    text = """\
job:
  nodes: "4:2"
  procs_per_nod: 2
scheduler:
  backend: slurm
diagnosis:
  checks:
    - host
    - backend: host
      timeout: abc
      options:
        pathz: [/tmp]
    - nosuch
"""
    found = problems(tmp_path, text)
    assert "job.nodes (line 2): min (4) is greater than max (2)" in found
    assert any(p.startswith("job.procs_per_nod (line 3)") for p in found)
    assert any(p.startswith("scheduler.backend (line 5)") for p in found)
    assert any(p.startswith("diagnosis.checks[1].timeout (line 10)") for p in found)
    assert any(p.startswith("diagnosis.checks[1].options.pathz (line 12)") for p in found)
    assert any(p.startswith("diagnosis.checks[2].backend (line 13)") for p in found)
    assert len(found) == 6


def test_overrides_apply_before_validation(tmp_path):
    path = write(tmp_path, GOOD)
    resolved, _ = load(
        path,
        [
            "diagnosis.preflight=false",
            "job.nodes=3",
            "diagnosis.checks[1].timeout=5s",
            "job.env.NCCL_DEBUG=INFO",
            "job.command=[python, -c, pass]",
        ],
    )
    assert resolved.config.diagnosis.preflight is False
    assert resolved.config.job.nodes == NodeRange(min=3, max=3)
    assert resolved.checks[1].timeout == 5.0
    assert resolved.config.job.env == {"NCCL_DEBUG": "INFO"}
    assert resolved.config.job.command == ["python", "-c", "pass"]


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("diagnosis.preflight", "expected PATH=VALUE"),
        ("=1", "expected PATH=VALUE"),
        ("diagnosis.checks[9].timeout=1s", "the list has only 2 item(s)"),
        ("job.name.first=x", "job.name is not a mapping"),
        ("job..name=x", "cannot parse the path"),
        ("job.nodes=[1", "--set job.nodes=[1"),
    ],
)
def test_bad_overrides(tmp_path, override, fragment):
    found = problems(tmp_path, GOOD, [override])
    assert any(fragment in p for p in found), found


def test_override_that_makes_the_config_invalid_is_reported_at_its_path(tmp_path):
    found = problems(tmp_path, GOOD, ["job.procs_per_node=many"])
    assert any(p.startswith("job.procs_per_node") for p in found), found


def test_plugins_disable_in_the_file_blocks_the_plugin(tmp_path):
    found = problems(tmp_path, "plugins: {disable: [host]}\n")
    assert any("diagnosis.checks[0].backend" in p and "disabled" in p for p in found), found


def test_schema_is_valid_and_follows_the_selected_backend():
    schema = config_schema(PluginManager.from_entry_points())
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    resolved_default, _ = load(None)
    assert not list(validator.iter_errors(json.loads(json.dumps(resolved_default.dump()))))
    good = {"job": {"nodes": "2:4"}, "diagnosis": {"checks": [{"backend": "host"}]}}
    assert not list(validator.iter_errors(good))
    bad = {"diagnosis": {"checks": [{"backend": "host", "options": {"pathz": []}}]}}
    assert any("pathz" in e.message for e in validator.iter_errors(bad))
    backend = schema["$defs"]["CheckSection"]["properties"]["backend"]
    assert "host" in backend["examples"]


def test_a_plugins_options_keep_their_schema_name_whatever_else_is_installed():
    from pydantic import BaseModel, ConfigDict

    import planaria
    from planaria.health.api import HealthCheckRecord
    from planaria.health.host import HostCheck

    class HostOptions(BaseModel):  # the same class name as the built-in host check's
        model_config = ConfigDict(extra="forbid")
        limit: int = 1

    class Twin:
        @planaria.hookimpl
        def planaria_health_checks(self):
            return [HealthCheckRecord(name="twin", factory=HostCheck, options=HostOptions)]

    alone = config_schema(PluginManager.from_entry_points())
    manager = PluginManager.from_entry_points()
    manager.register(Twin(), "twin", distribution="planaria-twin", version="1.0")
    both = config_schema(manager)
    key = "planaria.health.host.HostOptions"
    assert alone["$defs"][key] == both["$defs"][key]
    assert both["$defs"][key]["title"] == key
    twin = [k for k in both["$defs"] if k.endswith("HostOptions") and k != key]
    assert len(twin) == 1 and twin[0].startswith("test_config.")
    jsonschema.Draft202012Validator.check_schema(both)
    validator = jsonschema.Draft202012Validator(both)
    bad = {"diagnosis": {"checks": [{"backend": "twin", "options": {"paths": []}}]}}
    assert any("paths" in e.message for e in validator.iter_errors(bad))
    good = {"diagnosis": {"checks": [{"backend": "host", "options": {"paths": ["/tmp"]}}]}}
    assert not list(validator.iter_errors(good))


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30s", 30),
        ("5m", 300),
        ("500ms", 0.5),
        ("1h30m", 5400),
        ("1.5m", 90),
        (" 2 s ", 2),
        ("45", 45),
        (".25s", 0.25),
        (12, 12),
        (0.1, 0.1),
        ("1d", 86400),
    ],
)
def test_durations_parse(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@given(st.floats(min_value=0.001, max_value=1e7, allow_nan=False))
def test_duration_formatting_round_trips(seconds):
    assert parse_duration(format_duration(seconds)) == pytest.approx(seconds, rel=1e-5)


@given(st.text(max_size=12))
def test_duration_parser_never_crashes(text):
    try:
        assert parse_duration(text) > 0
    except ValueError as exc:
        assert str(exc)


@given(
    st.lists(
        st.tuples(st.integers(min_value=0, max_value=999), st.sampled_from(["ms", "s", "m", "h"])),
        min_size=1,
        max_size=4,
    )
)
def test_compound_durations_add_up(parts):
    factor = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    total = sum(n * factor[u] for n, u in parts)
    text = "".join(f"{n}{u}" for n, u in parts)
    if total > 0:
        assert parse_duration(text) == pytest.approx(total)
    else:
        with pytest.raises(ValueError):
            parse_duration(text)


@given(st.integers(min_value=1, max_value=10_000), st.integers(min_value=0, max_value=10_000))
def test_node_ranges(low, extra):
    high = low + extra
    text = str(low) if extra == 0 else f"{low}:{high}"
    nodes = NodeRange.model_validate(text)
    assert (nodes.min, nodes.max, str(nodes)) == (low, high, text)


@given(st.text(alphabet="abcxyz:{}[]- \n'\"0123456789", max_size=40))
def test_arbitrary_text_is_a_config_error_or_a_config(text):
    try:
        raw = parse_text(text, "fuzz.yaml")
    except ConfigError as exc:
        assert exc.issues
        return
    assert isinstance(raw.data, dict)


def test_rendezvous_backend_takes_its_options_and_master_still_reads(tmp_path):
    resolved, _ = load(
        write(tmp_path, "rendezvous: {backend: topology, options: {label: rack}}\n", "a.yaml")
    )
    topology = resolved.backends["rendezvous"]
    assert topology.record.name == "topology"
    assert topology.options == TopologyOptions(label="rack")
    assert resolved.dump()["rendezvous"]["options"] == {"label": "rack"}
    # Files from before rank placements were plugins: "master" placed ranks as stable does.
    old, _ = load(write(tmp_path, "rendezvous: {backend: master, join_grace: 3s}\n", "b.yaml"))
    assert old.backends["rendezvous"].record.name == "stable"
    assert old.config.rendezvous.join_grace == 3.0


def test_rendezvous_store_is_rank0_unless_the_file_says_master(tmp_path):
    default, _ = load(write(tmp_path, "rendezvous: {join_grace: 3s}\n", "a.yaml"))
    assert default.config.rendezvous.store == "rank0"
    master, _ = load(write(tmp_path, "rendezvous: {store: master}\n", "b.yaml"))
    assert master.config.rendezvous.store == "master"
    assert master.dump()["rendezvous"]["store"] == "master"  # a resumed master reads it back
