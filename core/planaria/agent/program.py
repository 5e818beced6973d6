"""Which commands the warm zygote can run: ``python [simple flags] (script | -m module | -c
code) args...`` run by this very interpreter. Anything else is exec'd as it is."""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

_PYTHON_NAME = re.compile(r"python(\d+(\.\d+)?)?\Z")
_SIMPLE_FLAGS = re.compile(r"-[uBO]+\Z")


@dataclass(frozen=True)
class PythonProgram:
    """What ``python [simple flags] (script | -m module | -c code) args...`` runs."""

    interpreter: str
    flags: tuple[str, ...]
    kind: str  # "script" | "module" | "code"
    target: str
    args: tuple[str, ...]


def is_python(executable: str) -> bool:
    return executable == sys.executable or bool(_PYTHON_NAME.match(os.path.basename(executable)))


def parse_python_command(command: Sequence[str]) -> PythonProgram | None:
    """The Python program a command runs; None if the zygote could not run it faithfully."""
    i = 1
    while i < len(command) and _SIMPLE_FLAGS.match(command[i]):
        i += 1
    if i >= len(command) or not is_python(command[0]):
        return None
    exe, flags, rest = command[0], tuple(command[1:i]), command[i:]
    if rest[0] in ("-m", "-c") and len(rest) > 1:
        kind = "module" if rest[0] == "-m" else "code"
        return PythonProgram(exe, flags, kind, rest[1], tuple(rest[2:]))
    if rest[0].startswith("-"):
        return None
    return PythonProgram(exe, flags, "script", rest[0], tuple(rest[1:]))


def find_program(program: str, cwd: Path, path: str) -> str | None:
    """Where ``program`` is, as ``execvp`` in ``cwd`` with this ``PATH`` would find it: a name
    with a slash relative to ``cwd``, else searched on ``path`` (an empty entry is ``cwd``);
    None when there is no executable file of that name."""
    if os.sep in program:
        candidates = [cwd / program]
    else:
        candidates = [cwd / (entry or ".") / program for entry in path.split(os.pathsep)]
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def same_interpreter(executable: str, cwd: Path, env: Mapping[str, str]) -> bool:
    """Whether ``executable``, as the worker would find it, is this interpreter in this
    environment: the same file in the same directory (a venv's python is a symlink to the base
    interpreter, yet has other site-packages)."""
    if not sys.executable or executable == sys.executable:
        return bool(sys.executable)
    found = (
        str(cwd / executable)
        if os.sep in executable
        else shutil.which(executable, path=env.get("PATH", os.defpath))
    )
    ours = os.path.abspath(sys.executable)
    try:
        found = os.path.abspath(found or "")
        return os.path.dirname(found) == os.path.dirname(ours) and os.path.samefile(found, ours)
    except OSError:
        return False
