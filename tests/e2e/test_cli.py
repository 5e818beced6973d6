"""The ``planaria`` command, run as a real process: output, JSON and exit codes."""

from __future__ import annotations

import json

import planaria


def test_version(cli):
    result = cli("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"planaria {planaria.__version__}"


def test_plugins_json_lists_host_with_its_distribution(cli):
    result = cli("plugins", "--json")
    assert result.returncode == 0, result.stderr
    plugins = {p["name"]: p for p in json.loads(result.stdout)}
    host = plugins["host"]
    assert host["distribution"] == "planaria"
    assert host["status"] == "loaded"
    assert host["kinds"] == ["health_check"]
    assert host["records"][0]["name"] == "host"
    assert host["records"][0]["summary"]


def test_plugins_shows_failed_and_blocked_plugins_with_reasons(cli):
    result = cli(
        "plugins", "--json", plugins=("broken", "good"), env={"PLANARIA_DISABLE_PLUGINS": "tempdir"}
    )
    assert result.returncode == 0, result.stderr
    plugins = {p["name"]: p for p in json.loads(result.stdout)}
    assert plugins["brokencheck"]["status"] == "failed"
    assert "No module named 'planaria_vendor_library" in plugins["brokencheck"]["reason"]
    assert plugins["tempdir"]["status"] == "blocked"
    # The import failure is a structured warning on stderr, never on the JSON stdout.
    assert "plugin failed to load" in result.stderr

    table = cli("plugins", plugins=("broken",))
    assert table.returncode == 0
    assert "brokencheck" in table.stdout and "failed" in table.stdout


def test_plugins_with_a_duplicate_name_exits_2_naming_both(cli):
    result = cli("plugins", plugins=("dup",))
    assert result.returncode == 2
    assert "planaria_fixture_dup 1.0" in result.stderr and "planaria 0" in result.stderr


def test_check_defaults_to_host_and_exits_0(cli):
    result = cli("check")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "healthy" in result.stdout
    for device in ("shm", "memory", "disk:"):
        assert device in result.stdout


def test_check_json_on_a_config_error_is_a_json_error_object_and_exit_2(cli, tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text("diagnosis:\n  checks:\n    - backend: host\n      options: {pathz: 1}\n")
    result = cli("check", "-c", str(config), "--json")
    assert result.returncode == 2, result.stderr
    report = json.loads(result.stdout)
    assert report["healthy"] is False and "invalid configuration" in report["error"]
    (problem,) = report["problems"]
    assert problem["path"] == "diagnosis.checks[0].options.pathz" and problem["line"] == 4
    assert "unknown key 'pathz'" in problem["message"]
    assert "invalid configuration" in result.stderr  # people still read stderr


def test_check_json_and_exit_1_when_unhealthy(cli, tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text(
        "diagnosis:\n  checks:\n    - host\n    - backend: host\n      name: greedy\n"
        "      options: {min_available_memory: 1PiB}\n"
    )
    result = cli("check", "-c", str(config), "--json")
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)
    assert report["healthy"] is False
    statuses = {c["check"]: c["status"] for c in report["checks"]}
    assert statuses == {"host": "ok", "greedy": "failed"}
    # --set turns the same config healthy.
    fixed = cli(
        "check",
        "-c",
        str(config),
        "--json",
        "--set",
        "diagnosis.checks[1].options.min_available_memory=1MiB",
    )
    assert fixed.returncode == 0, fixed.stderr
    assert json.loads(fixed.stdout)["healthy"] is True


def test_check_selecting_an_unknown_check_exits_2_listing_the_choices(cli, tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text("diagnosis:\n  checks: [host, nosuch]\n")
    result = cli("check", "-c", str(config))
    assert result.returncode == 2
    assert "diagnosis.checks[1].backend (line 2)" in result.stderr
    assert "health check 'nosuch' is not installed. Choose one of: " in result.stderr
    assert "host" in result.stderr
    assert "Traceback" not in result.stderr


def test_selecting_a_plugin_that_failed_shows_why(cli, tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text("scheduler:\n  backend: slurm\n")
    result = cli("config", "validate", str(config), plugins=("slurm",))
    assert result.returncode == 2
    assert "failed to load" in result.stderr and "libslurm.so.40" in result.stderr


def test_config_validate_show_and_schema(cli, tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text("job:\n  name: demo\n  nodes: '2:4'\n")
    valid = cli("config", "validate", str(config))
    assert valid.returncode == 0, valid.stderr
    assert "valid" in valid.stdout

    shown = cli("config", "show", str(config), "--json", "--set", "job.procs_per_node=4")
    assert shown.returncode == 0, shown.stderr
    data = json.loads(shown.stdout)
    assert data["job"]["nodes"] == "2:4" and data["job"]["procs_per_node"] == 4
    assert data["diagnosis"]["checks"][0]["options"]["min_free_disk"] == 1 << 30

    schema = cli("config", "schema")
    assert schema.returncode == 0
    assert "planaria.health.host.HostOptions" in json.loads(schema.stdout)["$defs"]


def test_config_errors_exit_2_without_traceback(cli, tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text("job:\n  nodes: many\nlogging: {format: xml}\n")
    result = cli("config", "validate", str(config))
    assert result.returncode == 2
    assert "2 problems" in result.stderr
    assert "job.nodes (line 2)" in result.stderr
    assert "Traceback" not in result.stderr
    missing = cli("config", "validate", str(tmp_path / "nope.yaml"))
    assert missing.returncode == 2 and "cannot read the file" in missing.stderr


def test_usage_errors_exit_2(cli):
    assert cli("check", "--no-such-flag").returncode == 2
    assert cli("--log-format", "xml", "plugins").returncode == 2
    assert cli("config", "validate").returncode == 2


def test_json_logs(cli, tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text("logging: {format: json}\n")
    result = cli("check", "-c", str(config), "--json", plugins=("broken",))
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    warning = next(entry for entry in lines if entry["event"].startswith("plugin failed"))
    assert warning["component"] == "plugins"
    assert warning["level"] == "warning"
    assert warning["plugin"] == "brokencheck"


def test_an_all_pass_preflight_is_one_line_not_an_empty_table(capsys):
    from planaria.cli.follow import print_preflight
    from planaria.master.preflight import PreflightReport

    report = PreflightReport(
        nodes=4,
        rounds=1,
        baseline={"matmul": 0.0101},
        slowest={"matmul": ("node-3", 0.0123)},
        hosts={f"node-{i}": f"local-{i}" for i in range(4)},
    )
    print_preflight(report)
    assert capsys.readouterr().out == (
        "pre-flight: all 4 nodes passed in 1 round (matmul: slowest 12.3 ms on node-3, "
        "median 10.1 ms)\n"
    )
    print_preflight(PreflightReport())
    assert capsys.readouterr().out == "pre-flight: no node was checked\n"
