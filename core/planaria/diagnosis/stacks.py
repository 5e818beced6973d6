"""Python stacks of live worker processes, taken from outside with py-spy.

``py-spy dump --pid`` reads the interpreter's memory, so it works on a worker blocked in a
collective, holding the GIL in C code, or stopped (SIGSTOP: then in non-blocking mode, which
does not need the process to run). It needs ptrace permission over the worker; the agent
started the workers, which is enough unless the kernel's Yama policy or a container forbids
ptrace. When py-spy is missing or refused, the dump says so instead of a stack.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sys
from pathlib import Path

MAX_LINES = 80
MAX_CHARS = 6000
TIMEOUT = 15.0


def find_py_spy() -> str | None:
    """py-spy beside this interpreter (a dependency of planaria), else on ``PATH``."""
    beside = Path(sys.executable).parent / "py-spy"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("py-spy")


def process_state(pid: int) -> str:
    """The kernel's state of ``pid`` (``S (sleeping)``, ``T (stopped)`` ...), or ``gone``."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("State:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "gone"


def truncate(text: str, max_lines: int = MAX_LINES, max_chars: int = MAX_CHARS) -> str:
    """Keep the head (the main thread comes first), and say how much was cut."""
    lines = text.rstrip("\n").splitlines()
    kept: list[str] = []
    size = 0
    for line in lines[:max_lines]:
        if size + len(line) + 1 > max_chars:
            break
        kept.append(line)
        size += len(line) + 1
    if len(kept) < len(lines):
        kept.append(f"... {len(lines) - len(kept)} more line(s) cut")
    return "\n".join(kept)


def main_thread_first(dump: str) -> str:
    """The threads of a py-spy dump, main thread first (py-spy lists them in no useful order),
    without its header (the process's command line: a zygote's is long and says nothing)."""
    header: list[str] = []
    threads: list[list[str]] = []
    current: list[str] = []
    for line in dump.splitlines():
        if line.startswith("Thread "):
            if current:
                threads.append(current)
            current = [line]
        elif current:
            current.append(line)
        else:
            header.append(line)
    if current:
        threads.append(current)
    threads.sort(key=lambda t: 0 if '"MainThread"' in t[0] else 1)
    if not threads:
        return "\n".join(header)
    return "\n".join(line for thread in threads for line in thread)


async def _run(argv: list[str], timeout: float) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except (asyncio.TimeoutError, asyncio.CancelledError):
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise
    return proc.returncode or 0, out.decode("utf-8", "replace"), err.decode("utf-8", "replace")


def _why(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    text = " ".join(lines[:3])[:400] or "no output"
    if "ermission" in text or "EPERM" in text or "ptrace" in text.lower():
        return (
            f"ptrace was refused ({text}); allow it (CAP_SYS_PTRACE, or "
            "kernel.yama.ptrace_scope=0) to see the stacks of hung workers"
        )
    return text


async def dump_stack(pid: int, py_spy: str | None, timeout: float = TIMEOUT) -> str:
    """The Python stack of every thread of ``pid``, truncated; or a note saying why not."""
    if py_spy is None:
        return (
            "no stack: py-spy is not installed (pip install py-spy; it comes with planaria) "
            "or not on PATH"
        )
    stopped = process_state(pid).startswith("T")
    attempts = [["--nonblocking"]] if stopped else [[], ["--nonblocking"]]
    why = ""
    for extra in attempts:
        try:
            code, out, err = await _run([py_spy, "dump", *extra, "--pid", str(pid)], timeout)
        except asyncio.TimeoutError:
            why = f"py-spy did not answer within {timeout:g}s"
            continue
        except OSError as exc:
            return f"no stack: cannot run {py_spy}: {exc}"
        if code == 0 and out.strip():
            return truncate(main_thread_first(out))
        why = _why(err or out)
    return f"no stack: py-spy failed: {why}"


async def dump_stacks(pids: dict[int, int], timeout: float = TIMEOUT) -> dict[int, str]:
    """Stacks of several processes at once, by key (a local rank)."""
    py_spy = find_py_spy()
    keys = list(pids)
    dumps = await asyncio.gather(*(dump_stack(pids[k], py_spy, timeout) for k in keys))
    return dict(zip(keys, dumps, strict=True))
