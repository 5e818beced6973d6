"""The warm zygote: a pre-imported Python interpreter that forks the user's Python workers.

Restarting workers must not pay interpreter start-up and ``import torch`` again. The agent
starts one zygote per launcher (see :mod:`planaria.agent.workers`). It imports the ``preload``
modules once, then serves JSON-line requests from the agent on a socket, single-threaded (its
main thread is the one that forks: fork-safe with torch and OpenMP). Each ``spawn`` forks a
child that becomes the worker as ``python script.py`` / ``python -m module`` would have started
it, minus the imports already done, and shows in ``ps`` as that command. The zygote reaps its
children and reports their exits; it never runs user code itself, so it stays pristine for the
next spawn.

Agent -> zygote: ``{"op": "spawn", "id", "local_rank", "env", "log_path"[, "err_path"]}``
(stderr goes to ``err_path`` when given, else with stdout), ``{"op": "shutdown"}`` (or EOF: it
then SIGKILLs its children). Zygote -> agent: ``ready``, ``spawned {id, pid}``, ``error {id,
error}``, ``exited {id, pid, exitcode, signal}``.

Standard library only (and setproctitle's C function, where installed): the zygote loads this
file by path, without the ``planaria`` package, so that the workers' ``sys.modules`` stays close
to a fresh interpreter's; likewise :mod:`planaria.process`, which sets the death signals.

Why one module: the zygote is one process whose every part runs in its single thread: the
server that answers the agent, and the child it forks that turns itself into the worker
(its arguments, ``sys.path``, ``__main__``, its exit). Being loaded by path is what keeps the
workers' modules pristine; each further file would be another by-path load and another module
in every worker. The agent's end of the protocol is :mod:`planaria.agent.zygote_client`.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import io
import json
import os
import select
import signal
import socket
import sys
import time
import traceback
import types
from collections.abc import Callable, Mapping
from importlib import import_module
from typing import TYPE_CHECKING, Any, NoReturn

PR_SET_NAME = 15
PR_SET_CHILD_SUBREAPER = 36
_setproctitle: Callable[[str], None] | None = None


def _load_by_path(name: str, path: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


if TYPE_CHECKING or __name__ != "_planaria_zygote":
    from planaria import process
else:  # the zygote itself (see BOOTSTRAP): the one planaria module it needs, by path
    process = _load_by_path(
        "_planaria_process", os.path.join(os.path.dirname(os.path.dirname(__file__)), "process.py")
    )


def load_setproctitle() -> Callable[[str], None] | None:
    """setproctitle's C function, or None if it is not installed. Loaded in the zygote, before
    any fork (a child should not dlopen), and without its package: that imports ``logging``,
    which every worker would then find already imported."""
    from importlib.machinery import PathFinder
    from importlib.util import module_from_spec

    try:
        package = PathFinder.find_spec("setproctitle")
        where = list(package.submodule_search_locations or []) if package else []
        spec = PathFinder.find_spec("setproctitle._setproctitle", where) if where else None
        if spec is None or spec.loader is None:
            return None
        module = module_from_spec(spec)
        spec.loader.exec_module(module)
        setter: Callable[[str], None] = module.setproctitle
        return setter
    except Exception:
        return None


def set_title(title: str) -> None:
    """Show this process as ``title`` in /proc/PID/cmdline (ps, top, ``pgrep -f``): a warm
    worker would otherwise show the zygote's bootstrap. Without setproctitle only the 15-byte
    comm name can change (what ``pgrep NAME`` and top's default view show)."""
    if _setproctitle is not None:
        # Over argv only (the zygote's, config included, is longer than any title): by default
        # it also writes over the environment block, and /proc/PID/environ would read empty.
        os.environ["SPT_NOENV"] = "1"
        try:
            _setproctitle(title)
            return
        except Exception:
            pass
        finally:
            os.environ.pop("SPT_NOENV", None)
    process.prctl(PR_SET_NAME, title.encode(errors="replace")[:15])


def _send(sock: socket.socket, message: Mapping[str, Any]) -> None:
    sock.sendall(json.dumps(message, separators=(",", ":")).encode() + b"\n")


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()


# --- the child: becomes the worker --------------------------------------------------------


def _child(config: Mapping[str, Any], req: Mapping[str, Any], handshake: int) -> NoReturn:
    """Runs in the forked child; always ends in os._exit, never back in the zygote's loop."""
    code = 1
    try:
        zygote = os.getppid()
        if config.get("title"):
            with contextlib.suppress(Exception):  # cosmetic: never a reason not to start
                set_title(str(config["title"]))
        os.setsid()
        process.die_with(zygote)
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        try:
            devnull = os.open(os.devnull, os.O_RDONLY)
            flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW
            log = os.open(req["log_path"], flags, 0o600)
            err = os.open(req["err_path"], flags, 0o600) if req.get("err_path") else log
            for fd, target in ((devnull, 0), (log, 1), (err, 2)):
                os.dup2(fd, target)
            for fd in {devnull, log, err}:
                os.close(fd)
            os.chdir(config["cwd"])
            os.environ.clear()
            os.environ.update(req["env"])
        except Exception as exc:
            os.write(handshake, b"E" + f"{type(exc).__name__}: {exc}".encode()[:4000])
            os._exit(127)
        os.write(handshake, b"K")
        os.close(handshake)
        _rebind_stdio()
        code = _run(config["program"], config["pythonpath"])
    except BaseException:
        with contextlib.suppress(BaseException):
            traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                code = code or 120  # as the interpreter does when flushing stdout fails
        os._exit(code & 0xFF)


def _rebind_stdio() -> None:
    """New sys.std* on fds 0-2, line-buffered (write-through under ``python -u``)."""
    encoding = getattr(sys.__stdout__, "encoding", None) or "utf-8"
    unbuffered = bool(getattr(sys.__stdout__, "write_through", False))

    def writer(fd: int, errors: str) -> io.TextIOWrapper:
        raw = io.FileIO(fd, "w", closefd=False)
        binary: Any = raw if unbuffered else io.BufferedWriter(raw)
        return io.TextIOWrapper(binary, encoding, errors, None, True, unbuffered)

    stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding)
    stdout = writer(1, getattr(sys.__stdout__, "errors", None) or "strict")
    for name, value in (
        ("stdin", stdin),
        ("stdout", stdout),
        ("stderr", writer(2, "backslashreplace")),
    ):
        setattr(sys, name, value)
        setattr(sys, f"__{name}__", value)


def path0_of(program: Mapping[str, Any]) -> str:
    """``sys.path[0]`` as the interpreter would set it for this program (in the current cwd)."""
    if program["kind"] == "module":
        return os.getcwd()
    if program["kind"] == "code":
        return ""
    script = os.path.abspath(str(program["target"]))
    return script if os.path.isdir(script) else os.path.dirname(os.path.realpath(script))


def _fix_up(program: Mapping[str, Any], old_pythonpath: str) -> None:
    """Make the interpreter state what a fresh one would have with this worker's env."""
    first = 0 if getattr(sys.flags, "safe_path", False) else 1  # -P: no sys.path[0]
    if first:
        sys.path[0] = path0_of(program)
    new = os.environ.get("PYTHONPATH", "")
    if new != old_pythonpath:  # PYTHONPATH entries come next, made absolute
        for entry in filter(None, old_pythonpath.split(os.pathsep)):
            with contextlib.suppress(ValueError):
                del sys.path[sys.path.index(os.path.abspath(entry), first)]
        sys.path[first:first] = [os.path.abspath(e) for e in new.split(os.pathsep) if e]
    torch, threads = sys.modules.get("torch"), os.environ.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        with contextlib.suppress(Exception):
            torch.set_num_threads(int(threads))
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:  # else every worker would draw the zygote's numbers
        with contextlib.suppress(Exception):
            numpy_random.seed()
    if os.environ.get("PYTHONFAULTHANDLER"):
        import faulthandler

        faulthandler.enable()


def _run(program: Mapping[str, Any], old_pythonpath: str) -> int:
    """Run the user's program as ``__main__``; return the exit status the interpreter would."""
    kind, target, args = program["kind"], program["target"], list(program["args"])
    _fix_up(program, old_pythonpath)
    main = types.ModuleType("__main__")  # a fresh __main__ that stays after the program ends
    main.__dict__["__builtins__"] = sys.modules["builtins"]
    sys.modules["__main__"] = main
    code = 0
    try:
        if kind == "module":
            import runpy

            sys.argv = ["-m", *args]  # runpy puts the module's path in argv[0], as `-m` does
            runpy._run_module_as_main(target, True)  # type: ignore[attr-defined]
        elif kind == "code":
            sys.argv = ["-c", *args]
            exec(compile(target, "<string>", "exec"), main.__dict__)
        else:
            sys.argv = [target, *args]
            code = _run_script(os.path.abspath(target), main)
    except SystemExit as exc:
        code = exit_code_of(exc.code)
    except KeyboardInterrupt as exc:  # python prints it, shuts down, then dies by SIGINT
        _print_uncaught(exc)
        _finalize()
        _flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        return 130
    except BaseException as exc:
        _print_uncaught(exc)
        code = 1
    _finalize()
    return code


def _run_script(path: str, main: types.ModuleType) -> int:
    if os.path.isdir(path) or path.endswith((".zip", ".pyz", ".pyc")):
        import runpy

        runpy.run_path(path, run_name="__main__")
        return 0
    try:
        with open(path, "rb") as f:
            source = f.read()
    except OSError as exc:
        print(f"{sys.executable}: can't open file {path!r}: {exc}", file=sys.stderr)
        return 2
    from importlib.machinery import SourceFileLoader

    main.__dict__.update(__file__=path, __cached__=None, __package__=None, __spec__=None)
    main.__loader__ = SourceFileLoader("__main__", path)
    exec(compile(source, path, "exec", dont_inherit=True), main.__dict__)
    return 0


def exit_code_of(code: object) -> int:
    """What the interpreter does with ``SystemExit(code)``: None -> 0, int -> it, else print, 1."""
    if code is None or isinstance(code, int):
        return code or 0
    with contextlib.suppress(Exception):
        print(code, file=sys.stderr)
    return 1


def _print_uncaught(exc: BaseException) -> None:
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next  # hide the zygote's own frames: a fresh interpreter has none
    exc.__traceback__ = tb  # the default hook prints this one, not its argument
    try:
        sys.excepthook(type(exc), exc, tb)
    except BaseException:
        traceback.print_exception(type(exc), exc, tb)


def _finalize() -> None:
    """Interpreter shutdown: join non-daemon threads, then run the atexit callbacks."""
    import atexit
    import threading

    shutdown: Callable[[], None] | None = getattr(threading, "_shutdown", None)
    try:
        if shutdown is not None:
            shutdown()
    except BaseException as exc:
        _print_uncaught(exc)
    getattr(atexit, "_run_exitfuncs", lambda: None)()


# --- the zygote ---------------------------------------------------------------------------


_WORKER_MODULES = ("planaria.monitor", "planaria.checkpoint.checkpointer")


class Zygote:
    def __init__(self, config: dict[str, Any], sock: socket.socket) -> None:
        self.config = config
        self.sock = sock
        self.children: dict[int, int] = {}  # pid -> request id
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def preload(self) -> None:
        started = time.monotonic()
        loaded, failed = [], {}
        for name in self.config["preload"]:
            try:
                import_module(name)
                loaded.append(name)
            except BaseException as exc:  # a broken preload must never stop the zygote
                failed[name] = f"{type(exc).__name__}: {exc}"
        if "torch" in sys.modules:
            # planaria's own worker side (the flash checkpoint: ~0.2 s to import) comes warm
            # too; best effort, it is no preload the job asked for.
            for name in _WORKER_MODULES:
                with contextlib.suppress(Exception):
                    import_module(name)
                    loaded.append(name)
        torch = sys.modules.get("torch")
        cuda = bool(torch is not None and torch.cuda.is_initialized())  # forks could not use it
        gc.collect()
        gc.freeze()  # children's collections then leave the shared (copy-on-write) pages alone
        ready = {"type": "ready", "pid": os.getpid(), "preloaded": loaded, "failed": failed}
        ready.update(cuda_initialized=cuda, threads=len(os.listdir("/proc/self/task")))
        _send(self.sock, {**ready, "seconds": round(time.monotonic() - started, 3)})

    def serve(self) -> None:
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)
        sock, buf = self.sock.fileno(), b""
        while True:
            ready, _, _ = select.select([sock, self.wake_r], [], [])
            if self.wake_r in ready:
                with contextlib.suppress(BlockingIOError):
                    while os.read(self.wake_r, 512):
                        pass
                self.reap()
            if sock in ready:
                data = self.sock.recv(1 << 16)
                if not data:
                    return
                *lines, buf = (buf + data).split(b"\n")
                for line in lines:
                    req = json.loads(line)
                    if req.get("op") == "shutdown":
                        return
                    self.spawn(req)

    def spawn(self, req: Mapping[str, Any]) -> None:
        hs_r, hs_w = os.pipe2(os.O_CLOEXEC)
        _flush()
        try:
            pid = os.fork()
        except OSError as exc:
            os.close(hs_r)
            os.close(hs_w)
            _send(self.sock, {"type": "error", "id": req["id"], "error": f"fork: {exc}"})
            return
        if pid == 0:
            for fd in (hs_r, self.sock.fileno(), self.wake_r, self.wake_w):
                os.close(fd)
            _child(self.config, req, hs_w)
        os.close(hs_w)
        try:  # wait until the child is in its own session and has its log (or failed to)
            reply = os.read(hs_r, 4096) if select.select([hs_r], [], [], 60.0)[0] else b""
        finally:
            os.close(hs_r)
        if reply == b"K":
            self.children[pid] = req["id"]
            _send(
                self.sock,
                {"type": "spawned", "id": req["id"], "pid": pid, "local_rank": req["local_rank"]},
            )
        else:
            process.signal_group(pid, signal.SIGKILL, leader=True)
            why = reply[1:].decode(errors="replace") or "the child died while starting"
            _send(self.sock, {"type": "error", "id": req["id"], "error": why})

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            rid = self.children.pop(pid, None)
            if rid is None:
                continue  # an orphaned grandchild (we are a subreaper) or a failed start
            process.signal_group(pid, signal.SIGKILL)  # what it left in its group
            sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
            code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
            msg = {"type": "exited", "id": rid, "pid": pid, "exitcode": code, "signal": sig}
            _send(self.sock, msg)

    def shutdown(self) -> None:
        for pid in self.children:
            process.signal_group(pid, signal.SIGKILL, leader=True)
        deadline = time.monotonic() + 5.0
        while self.children and time.monotonic() < deadline:
            try:
                self.reap()
            except OSError:  # the agent is gone: nobody to report to
                self.children.clear()
            time.sleep(0.005)


def main(raw_config: str) -> None:
    global _setproctitle
    config = json.loads(raw_config)
    process.die_with(int(config["parent"]))
    _setproctitle = load_setproctitle()
    with contextlib.suppress(Exception):  # its argv holds the program: pgrep -f would find it
        set_title(f"planaria zygote (warm interpreter of agent {config['parent']})")
    with contextlib.suppress(OSError):
        process.prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphaned grandchildren come to us to be reaped
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the agent decides when workers stop
    sock = socket.socket(fileno=int(config["fd"]))
    if not getattr(sys.flags, "safe_path", False):  # preloads resolve as workers' imports do
        sys.path[0] = path0_of(config["program"])
    config["pythonpath"] = os.environ.get("PYTHONPATH", "")
    zygote = Zygote(config, sock)
    try:
        zygote.preload()
        zygote.serve()
    except (BrokenPipeError, ConnectionResetError):
        pass
    finally:
        zygote.shutdown()


# How the agent starts it: ``python [flags] -c BOOTSTRAP <this file> <config json>``.
BOOTSTRAP = (
    "import importlib.util as u, sys\n"
    "s = u.spec_from_file_location('_planaria_zygote', sys.argv[1])\n"
    "m = u.module_from_spec(s); sys.modules[s.name] = m; s.loader.exec_module(m)\n"
    "m.main(sys.argv[2])\n"
)
