"""``planaria submit``'s batch script against hostile values, without a cluster: every config
value and path it writes is either refused, by an error naming its field and the character, or
reaches sbatch and the shell as itself. The script is run for real, by sh and by bash, with a
stand-in for Python that records the argv and directory it was given; a value that became
code would leave a file behind."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from planaria_slurm import SlurmOptions, SlurmScheduler, state
from planaria_slurm.submit import PLAIN
from pydantic import ValidationError

from planaria.errors import ConfigError
from planaria.plugin import SubmitRequest

PLANTED = "PLANTED"
"""The file a value that ran as code would make (relative: in whatever directory it ran)."""

FRAGMENTS = st.sampled_from(
    [
        "\n", "\r", "\0", " ", "\t", "\v", "'", '"', "\\", "#", "%j", "%%", "$HOME", "*",
        f"$(touch {PLANTED})", f"`touch {PLANTED}`", f";touch {PLANTED};", f"&&touch {PLANTED}",
        f"|touch {PLANTED}", f"\ntouch {PLANTED}\n", f"'; touch {PLANTED}; '",
        f'"; touch {PLANTED}; "', f"\n#SBATCH --wrap='touch {PLANTED}'\n", "--x=1 --y",
        "é", "日本", "\u2028", "\x85", "\xa0", "-", "a", "node1",
    ]
)  # fmt: skip
HOSTILE = st.lists(FRAGMENTS | st.text(max_size=3), max_size=5).map("".join)
"""Any text, rich in what a shell or sbatch would read as syntax."""
WORD = st.from_regex(r"\A[A-Za-z0-9_.:-]{1,12}\Z")
SOME = st.one_of(WORD, WORD, WORD, HOSTILE)
"""A value of a field whose refusal should not hide the others': mostly plain."""


def _name(text: str) -> str:
    """``text`` as one file name: no '/' or NUL, not '.' or '..', not empty."""
    name = text.replace("/", "_").replace("\0", "_")
    return name if name not in ("", ".", "..") else f"x{name}"


NAMES = HOSTILE.map(_name)

SH = [shell for shell in ("/bin/sh", shutil.which("bash")) if shell]

# The stand-in for Python. Asked for the batch host's address (planaria_slurm.address), it
# answers PLANARIA_TEST_ADDRESS, or fails when that is unset; otherwise it records what
# `exec python -m planaria run ...` hands it, NUL-separated, with the advertised address the
# environment carries.
RECORDER = """#!/bin/sh
if [ "$2" = planaria_slurm.address ]; then
    [ -n "${PLANARIA_TEST_ADDRESS+set}" ] || exit 2
    printf '%s\\n' "$PLANARIA_TEST_ADDRESS"
    exit 0
fi
printf '%s\\0' "$PWD" "${PLANARIA_MASTER_ADVERTISE-<unset>}" "$0" "$@" > "$PLANARIA_TEST_RECORD"
"""
STALE = "stale-address-from-the-submitting-shell"
"""What sbatch's environment may carry already: replaced, or unset when no address is found."""
ADDRESSES = HOSTILE.map(lambda a: a.replace("\0", "").rstrip("\n"))
"""Whatever the address step prints (a shell keeps no NUL, and drops trailing newlines)."""


def _request(sandbox: Path, values: dict[str, Any]) -> SubmitRequest:
    directory = sandbox / "cwd" / values["directory"]
    directory.mkdir(parents=True)
    python = sandbox / "bin" / values["python"] / "python"
    python.parent.mkdir(parents=True)
    python.write_text(RECORDER)
    python.chmod(stat.S_IRWXU)
    return SubmitRequest(
        config=sandbox / "config" / values["config"] / "job.yaml",
        overrides=tuple(values["overrides"]),
        job=values["job"],
        min_nodes=1,
        max_nodes=2,
        procs_per_node=1,
        workdir=sandbox / "work" / values["workdir"],
        directory=directory,
        python=str(python),
    )


def _refused_naming(error: ConfigError, fields: set[str]) -> None:
    """A refusal names a field given a hostile value, and the character it cannot carry."""
    assert error.issues, error
    for issue in error.issues:
        assert any(issue.path.startswith(field) for field in fields), (issue.path, fields)
        assert " holds " in issue.message or " is empty" in issue.message, issue.message


def _sbatch_block(script: str) -> list[str]:
    """The #SBATCH lines sbatch reads: those before the first line that is no comment."""
    lines = []
    for line in script.split("\n")[1:]:
        if line.strip() and not line.startswith("#"):
            break
        if line.startswith("#SBATCH"):
            lines.append(line)
    return lines


def _run(script: str, sandbox: Path, shell: str, address: str | None = None) -> list[str]:
    path = sandbox / "batch.sh"
    path.write_text(script, encoding="utf-8")
    record = sandbox / "record"
    start = sandbox / "start"
    start.mkdir(exist_ok=True)
    done = subprocess.run(
        [shell, str(path)],
        cwd=start,
        env={
            "PATH": os.environ["PATH"],
            "PLANARIA_TEST_RECORD": str(record),
            "PLANARIA_MASTER_ADVERTISE": STALE,
            **({} if address is None else {"PLANARIA_TEST_ADDRESS": address}),
        },
        capture_output=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    recorded = record.read_bytes().decode("utf-8").split("\0")[:-1]
    record.unlink()
    return recorded


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    values=st.fixed_dictionaries(
        {
            "job": SOME,
            "directory": NAMES,
            "workdir": WORD | NAMES,
            "config": NAMES,
            "python": NAMES,
            "overrides": st.lists(HOSTILE, max_size=2),
            "state_dir": st.none() | st.tuples(st.booleans(), WORD | NAMES),
            "bad_nodes": st.lists(SOME, max_size=2),
            "address": st.none() | ADDRESSES,
        }
    ),
    options=st.fixed_dictionaries(
        {},
        optional={
            "partition": SOME,
            "time": SOME,
            "account": SOME,
            "gres": SOME,
            "gpus_per_node": SOME,
            "constraint": SOME,
            "sbatch": st.lists(HOSTILE.map(lambda line: f"--{line}"), max_size=2),
        },
    ),
)
def test_every_value_is_refused_naming_its_field_or_reaches_sbatch_and_the_shell_intact(
    values: dict[str, Any], options: dict[str, Any]
) -> None:
    with tempfile.TemporaryDirectory(prefix="planaria-submit-") as raw:
        sandbox = Path(raw)
        request = _request(sandbox, values)
        if values["state_dir"] is not None:
            absolute, name = values["state_dir"]
            options["state_dir"] = sandbox / "state" / name if absolute else Path(name)
        try:
            chosen = SlurmOptions(**options)
        except ValidationError as exc:
            for error in exc.errors():
                assert error["loc"][0] in options, error
            event("refused by the options model")
            return
        where = (
            request.workdir / ".planaria"
            if chosen.state_dir is None
            else request.directory / chosen.state_dir
        )
        where.mkdir(parents=True, exist_ok=True)
        bad = [n.strip() for n in values["bad_nodes"] if "\n" not in n and "\r" not in n]
        (where / state.BAD_NODES).write_text("".join(f"{n} planted\n" for n in bad))
        remembered = sorted(state.load(where))
        try:
            result = SlurmScheduler.submit(chosen, request, dry_run=True)
        except ConfigError as exc:
            fields = {"job.name", "job.workdir", "scheduler.options.state_dir", "--set"}
            fields |= {"the config file", "the directory", "the Python", str(where)}
            _refused_naming(exc, fields)
            event(f"refused: {exc.issues[0].path.split(' ')[0].rpartition('/')[2]}")
            return
        script = result.script

        expected = [
            f"#SBATCH --job-name={request.job}",
            "#SBATCH --nodes=2",
            "#SBATCH --ntasks-per-node=1",
            "#SBATCH --no-kill",
            f"#SBATCH --output={where}/slurm-%j.out",
        ]
        for field in ("partition", "time", "account", "gres", "gpus_per_node", "constraint"):
            if getattr(chosen, field) is not None:
                expected.append(f"#SBATCH --{field.replace('_', '-')}={getattr(chosen, field)}")
        if remembered:
            expected.append(f"#SBATCH --exclude={','.join(remembered)}")
        ours = len(expected)
        expected += [f"#SBATCH {line}" for line in chosen.sbatch]
        block = _sbatch_block(script)
        assert block == expected, script
        # What planaria writes itself is one plain word, which sbatch reads as it is; the
        # constraint's own syntax (&|!*()) is sbatch's too, and no shell's in a comment.
        for line in block[:ours]:
            value = line.partition("=")[2]
            assert set(value) <= PLAIN | set("%&|!*()"), line

        wanted = [
            str(request.directory),
            "<unset>" if values["address"] is None else values["address"],
            request.python,
            "-m", "planaria", "run", str(request.config),
            *[arg for override in request.overrides for arg in ("--set", override)],
            "--set", f"scheduler.options.state_dir={where}",
        ]  # fmt: skip
        for shell in SH:
            assert _run(script, sandbox, shell, values["address"]) == wanted, (shell, script)
        event("written and run")
        planted = [str(p) for p in sandbox.rglob(f"*{PLANTED}*") if p.name == PLANTED]
        assert planted == [], script


def test_a_newline_in_the_workdir_is_refused_naming_the_field_and_the_character(
    tmp_path: Path,
) -> None:
    workdir = tmp_path / f"w\ntouch {PLANTED}"
    request = SubmitRequest(
        config=tmp_path / "job.yaml",
        job="train",
        min_nodes=1,
        max_nodes=1,
        procs_per_node=1,
        workdir=workdir,
        directory=tmp_path,
        python="python3",
    )
    with pytest.raises(ConfigError) as refused:
        SlurmScheduler.submit(SlurmOptions(), request, dry_run=True)
    message = str(refused.value)
    assert "job.workdir" in message
    assert "holds '\\n', which #SBATCH --output cannot carry" in message


def test_a_directory_with_spaces_quotes_and_dollars_is_where_the_job_runs(tmp_path: Path) -> None:
    """Not an #SBATCH line: sbatch runs in it (its working directory is the job's), and the
    script changes to it, quoted."""
    directory = tmp_path / f"my runs/$(touch {PLANTED}) 'x' \"y\" #z"
    directory.mkdir(parents=True)
    request = SubmitRequest(
        config=tmp_path / "job.yaml",
        job="train",
        min_nodes=1,
        max_nodes=1,
        procs_per_node=1,
        workdir=tmp_path / "work",
        directory=directory,
        python="python3",
    )
    script = SlurmScheduler.submit(SlurmOptions(), request, dry_run=True).script
    assert "--chdir" not in script
    cd = next(line for line in script.splitlines() if line.startswith("cd "))
    shown = subprocess.run(
        ["sh", "-c", f"{cd} && pwd"], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert shown.stdout.strip() == str(directory)
    assert not list(tmp_path.rglob(PLANTED))
