"""``planaria run`` with torchrun's command line: how the line is cut and read (pure, through
the real click command without running it), the errors for a bad line (the real command), and
one real job started torchrun's way."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import typer
import typer.main

from planaria.cli.entry import app
from planaria.cli.launch import LaunchError, TorchrunFlags, training_command
from planaria.cli.line import META_LITERAL
from planaria.config import read
from planaria.testing.jobs import EXAMPLE, events, run

RUN = typer.main.get_command(app).commands["run"]  # type: ignore[attr-defined]
PY = sys.executable


def parse(*args: str) -> dict[str, Any]:
    """What ``planaria run ARGS`` hands its function: the parameters that were given, the
    command's words, and whether they came after ``--``."""
    ctx = RUN.make_context("run", list(args))
    given = {k: v for k, v in ctx.params.items() if v is not None and v is not False and v != []}
    given = {k: list(v) if isinstance(v, tuple) else v for k, v in given.items() if v != ()}
    given["literal"] = ctx.meta[META_LITERAL]
    given.setdefault("command", [])
    return given


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        # torchrun's line: flags, the script, then the script's own arguments
        (
            ("--nnodes", "1:2", "--nproc-per-node", "4", "--max-restarts", "3", "train.py"),
            {"nnodes": "1:2", "nproc_per_node": "4", "max_restarts": 3, "command": ["train.py"]},
        ),
        # underscore spellings and --flag=value
        (
            ("--nproc_per_node=2", "--max_restarts=0", "--rdzv_id=exp-1", "t.py"),
            {"nproc_per_node": "2", "max_restarts": 0, "rdzv_id": "exp-1", "command": ["t.py"]},
        ),
        (("--run-id", "exp.2", "t.py"), {"rdzv_id": "exp.2", "command": ["t.py"]}),
        # one launcher per node
        (
            ("--rdzv_backend=c10d", "--rdzv-endpoint", "head:29400", "--node_rank=1", "t.py"),
            {
                "rdzv_backend": "c10d",
                "rdzv_endpoint": "head:29400",
                "node_rank": 1,
                "command": ["t.py"],
            },
        ),
        # after the script, every word is the script's, ours or not
        (
            ("--nnodes", "2", "t.py", "--lr", "0.1", "-c", "x.yaml", "--nnodes", "9", "--", "-m"),
            {
                "nnodes": "2",
                "command": ["t.py", "--lr", "0.1", "-c", "x.yaml", "--nnodes", "9", "--", "-m"],
            },
        ),
        (("t.py", "--help"), {"command": ["t.py", "--help"]}),
        # -m and --no-python are flags: the next word is the module or the program
        (("-m", "pkg.train", "--x"), {"module": True, "command": ["pkg.train", "--x"]}),
        (("--no_python", "./run.sh", "a"), {"no_python": True, "command": ["./run.sh", "a"]}),
        (("--standalone", "t.py"), {"standalone": True, "command": ["t.py"]}),
        # the job file: positional (first word ending .yaml/.yml/.toml) or -c/--config
        (
            ("examples/local.yaml", "--set", "job.nodes=1", "--", "python", "x.py", "--steps", "3"),
            {
                "file": Path("examples/local.yaml"),
                "set_": ["job.nodes=1"],
                "command": ["python", "x.py", "--steps", "3"],
                "literal": True,
            },
        ),
        (("job.toml",), {"file": Path("job.toml")}),
        (
            ("job.yml", "--chaos", "kill_worker rank=1 at_step=2", "--nnodes", "3", "t.py", "a"),
            {
                "file": Path("job.yml"),
                "chaos": ["kill_worker rank=1 at_step=2"],
                "nnodes": "3",
                "command": ["t.py", "a"],
            },
        ),
        (
            ("-c", "job.yaml", "--nnodes", "2", "t.py"),
            {"config": Path("job.yaml"), "nnodes": "2", "command": ["t.py"]},
        ),
        # with -c given, a positional ending .yaml is the script
        (
            ("--config=job.yaml", "gen.yaml"),
            {"config": Path("job.yaml"), "command": ["gen.yaml"]},
        ),
        (("--", "./run.sh", "--x"), {"command": ["./run.sh", "--x"], "literal": True}),
        (
            ("--master-addr", "10.0.0.1", "--master_port", "29500", "--log-dir", "runs", "t.py"),
            {
                "master_addr": "10.0.0.1",
                "master_port": 29500,
                "log_dir": "runs",
                "command": ["t.py"],
            },
        ),
        (("--shutdown-timeout", "7.5", "t.py"), {"shutdown_timeout": 7.5, "command": ["t.py"]}),
        (
            ("-r", "3", "--tee=0:1", "--local_ranks_filter", "0,1", "t.py", "-r", "x"),
            {
                "redirects": "3",
                "tee": "0:1",
                "local_ranks_filter": "0,1",
                "command": ["t.py", "-r", "x"],
            },
        ),
        (("--monitor_interval", "1", "t.py"), {"monitor_interval": 1.0, "command": ["t.py"]}),
        (("--resume", "runs/r1"), {"resume": Path("runs/r1")}),
    ],
)
def test_line_is_cut_before_the_script_and_read_as_torchrun_does(args, expected):
    expected = {"literal": False, "command": [], **expected}
    assert parse(*args) == expected


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (("--nnodes", "2:1", "t.py"), ["--nnodes", "min (2) is greater than max (1)"]),
        (("--nnodes", "two", "t.py"), ["--nnodes", "'two'"]),
        (("--nnodes", "0", "t.py"), ["--nnodes"]),
        (("--nproc-per-node", "many", "t.py"), ["--nproc-per-node", "cpu, gpu or auto"]),
        (("--nproc-per-node", "0", "t.py"), ["--nproc-per-node", "between 1 and 1024"]),
        (("--nproc-per-node", "99999999999", "t.py"), ["--nproc-per-node", "between 1"]),
        (("--max-restarts", "-1", "t.py"), ["--max-restarts"]),
        (("--max-restarts", "x", "t.py"), ["--max-restarts", "valid integer"]),
        (("--master-port", "70000", "t.py"), ["--master-port"]),
        (("--rdzv-id", "a b", "t.py"), ["--rdzv-id", "is no job name"]),
        (("--nnodes",), ["--nnodes", "requires an argument"]),
        (("--lr", "0.1", "t.py"), ["No such option", "--lr"]),
        (("--rdzv-conf", "x=1", "t.py"), ["--rdzv-conf", "rendezvous section"]),
        # refused on every line, not only one with --rdzv-endpoint
        (("--rdzv-backend", "etcd", "t.py"), ["--rdzv-backend", "'etcd'", "c10d, static"]),
        (("--node-rank", "-1", "t.py"), ["--node-rank"]),
        (("-r", "4", "t.py"), ["'-r'", "0 (neither), 1 (stdout), 2 (stderr) or 3 (both)"]),
        (("--tee", "0:x", "t.py"), ["'-t' / '--tee'", "'0:x'", "LOCAL_RANK:STREAMS"]),
        (("--local-ranks-filter", "a", "t.py"), ["--local-ranks-filter", "'a'"]),
    ],
)
def test_a_bad_flag_is_named(args, names):
    with pytest.raises(Exception) as caught:  # typer's own click's UsageError
        parse(*args)
    assert getattr(caught.value, "exit_code", None) == 2, caught.value
    message = caught.value.format_message()
    for name in names:
        assert name in message


@pytest.mark.parametrize(
    ("tail", "flags", "literal", "command"),
    [
        (["t.py", "--lr", "1"], {}, False, [PY, "t.py", "--lr", "1"]),
        (["pkg.train", "--x"], {"module": True}, False, [PY, "-m", "pkg.train", "--x"]),
        (["./run.sh", "a"], {"no_python": True}, False, ["./run.sh", "a"]),
        (["./run.sh", "a"], {}, True, ["./run.sh", "a"]),
        # the form that came before torchrun's: a command that starts with python is as written
        (["python", "x.py"], {}, False, ["python", "x.py"]),
        (["python3", "-u", "x.py"], {}, False, ["python3", "-u", "x.py"]),
        ([PY, "x.py"], {}, False, [PY, "x.py"]),
        ([], {}, False, []),
    ],
)
def test_training_command(tail, flags, literal, command):
    assert training_command(tail, TorchrunFlags(**flags), literal) == command


def test_the_interpreter_is_python_exec_when_set(monkeypatch):
    monkeypatch.setenv("PYTHON_EXEC", "/opt/py/bin/python3")
    assert training_command(["t.py"], TorchrunFlags(), False) == ["/opt/py/bin/python3", "t.py"]


@pytest.mark.parametrize(
    ("tail", "flags", "literal", "says"),
    [
        (["t.py"], {"module": True, "no_python": True}, False, "not both"),
        ([], {"module": True}, False, "need a training script"),
        (["./run.sh"], {"module": True}, True, "given as written"),
        (["python", "x.py"], {"no_python": True}, False, "given as written"),
    ],
)
def test_training_command_refuses(tail, flags, literal, says):
    with pytest.raises(LaunchError, match=says):
        training_command(tail, TorchrunFlags(**flags), literal)


def test_flags_override_the_job_file(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("job: {name: a, nodes: 4, procs_per_node: 8, max_restarts: 9}\n")
    raw = read(path)
    flags = TorchrunFlags(
        nnodes="1:2",
        nproc_per_node="cpu",
        max_restarts=0,
        rdzv_id="b",
        master_addr="0.0.0.0",
        master_port=29500,
        log_dir="runs",
        redirects="0:1,1:2",
        tee="1",
        local_ranks_filter="0",
        shutdown_timeout=3.0,
    )
    flags.apply(raw)
    assert raw.data["job"] == {
        "name": "b",
        "nodes": "1:2",
        "procs_per_node": os.cpu_count(),
        "max_restarts": 0,
        "stop_grace": 3.0,
        "logs": {"dir": "runs", "redirects": "0:1,1:2", "tee": "1", "local_ranks_filter": "0"},
    }
    assert raw.data["master"] == {"host": "0.0.0.0", "port": 29500}
    untouched = read(path)
    TorchrunFlags().apply(untouched)
    job = {"name": "a", "nodes": 4, "procs_per_node": 8, "max_restarts": 9}
    assert untouched.data == {"job": job}


def test_nproc_auto_without_a_gpu_is_the_cpus_and_gpu_is_refused():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA devices")
    assert parse("--nproc-per-node", "auto", "t.py")["nproc_per_node"] == "auto"
    assert TorchrunFlags(nproc_per_node="auto").overrides()[("job", "procs_per_node")] == (
        os.cpu_count()
    )
    with pytest.raises(typer.BadParameter, match="per CUDA device; there is none"):
        parse("--nproc-per-node", "gpu", "t.py")


# -- the real command ---------------------------------------------------------------------------


def test_bad_lines_exit_2_naming_the_flag(cli):
    for args, says in [
        (("--rdzv-backend", "etcd", "--rdzv-endpoint", "h:1", "t.py"), "'etcd'"),
        (("--rdzv-endpoint", "h:1", "--master-port", "2", "t.py"), "--master-port"),
        (("--rdzv-endpoint", "h:99999", "t.py"), "port 99999"),
        (("--node-rank", "1", "t.py"), "--node-rank needs --rdzv-endpoint"),
        (("--set", "scheduler.backend=external", "t.py"), "--rdzv-endpoint HOST:PORT"),
        (("--nnodes", "3:2", "t.py"), "--nnodes"),
        (("--nnodes", "2"), "training script"),
        (("-m", "--no-python", "t.py"), "not both"),
        (("job.yaml", "-c", "other.yaml"), "give the job file once"),
        (("--resume", "runs/r", "--nnodes", "2"), "torchrun flags"),
    ]:
        result = cli("run", *args)
        assert result.returncode == 2, (args, result.stdout, result.stderr)
        assert says in result.stderr, (args, result.stderr)


def test_a_job_started_torchruns_way_trains_on_2_nodes_of_2_workers(tmp_path, mark):
    result = run(
        tmp_path,
        mark,
        *("--nnodes", "2", "--nproc-per-node", "2", "--max-restarts", "1"),
        *(str(EXAMPLE), "--steps", "10"),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    timeline = events(tmp_path)
    (round_,) = [e for e in timeline if e["kind"] == "rendezvous_completed"]
    assert round_["data"]["world_size"] == 4
    assert sorted(round_["data"]["ranks"].values()) == [0, 1]
    finished = [e for e in timeline if e["kind"] == "job_finished"]
    assert finished, timeline
    assert re.search(r"steps done\W+10\b", result.stdout), result.stdout  # --steps reached it


# -- the README's table of torchrun's flags -------------------------------------------------------

ROW = re.compile(r"^\| (`-.*?) \| (supported|ignored|refused)\b(.*) \|$", re.MULTILINE)


def readme_flags() -> list[tuple[list[str], str, str]]:
    """The README's rows: the example's words (the first in backticks), what planaria does,
    and the rest of the row."""
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    rows = []
    for flags, verdict, rest in ROW.findall(text):
        example = re.findall(r"`([^`]+)`", flags)[0].split()
        rows.append((example, verdict, rest.removeprefix(":").strip()))
    return rows


def test_the_readme_names_every_flag_of_torchrun():
    run = pytest.importorskip("torch.distributed.run")
    theirs = {
        name
        for action in run.get_args_parser()._actions
        for name in action.option_strings
        if name not in ("-h", "--help") and "_" not in name
    }
    ours = {word for words, _, _ in readme_flags() for word in words if word.startswith("-")}
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    shown = set(re.findall(r"^\| ([^|]*) \|", text, re.MULTILINE))
    named = {flag for cell in shown for flag in re.findall(r"`(-[-\w]+)", cell)}
    assert len(readme_flags()) >= 30
    assert theirs - named == set(), "torchrun flags the README's table leaves out"
    assert ours <= theirs | {"--run-id"}


@pytest.mark.parametrize(
    ("example", "verdict", "why"), readme_flags(), ids=[r[0][0] for r in readme_flags()]
)
def test_each_torchrun_flag_does_what_the_readme_says(example, verdict, why):
    """A supported or ignored flag is taken (with the README's example value); a refused one
    is refused with the README's reason."""
    if verdict != "refused":
        given = parse(*example, "t.py")
        assert given["command"] == ["t.py"], given
        return
    with pytest.raises(Exception) as caught:
        parse(*example, "t.py")
    assert getattr(caught.value, "exit_code", None) == 2, caught.value
    assert " ".join(why.split()) in " ".join(caught.value.format_message().split())
