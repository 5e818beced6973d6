"""``planaria run --rdzv-endpoint HOST:PORT``: one launcher per node, the way torchrun runs.

Whoever starts the launchers (``srun``, ``mpirun``, ``pdsh``, a Kubernetes Indexed Job) starts
one on every node with the same line. Each decides its role alone, without talking to the
others:

- the **master**: the launcher whose machine holds the endpoint (HOST resolves to an address
  of one of its interfaces), or, when ``--node-rank`` is given, the launcher of node rank 0.
  It serves the job's API on PORT (over TLS, always) and starts its own node's agent; the
  scheduler is ``external`` (:mod:`planaria.scheduler.external`): it starts no other node and
  replaces none.
- every other launcher is an **agent**: it learns the master's certificate by channel
  binding (:mod:`planaria.master.binding`), trying every second while no master answers,
  for ``rendezvous.join_timeout`` (default 300 s), then runs its node's agent in its own
  process.

The launchers share one secret, ``PLANARIA_TOKEN`` in their environment (``srun`` passes the
environment on). Without it nothing starts: an unauthenticated job is never run silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path

from planaria import log
from planaria.cli.app import EXIT_USAGE, configure_logging
from planaria.cli.output import error, out
from planaria.config import RawConfig, load_raw, read
from planaria.errors import PlanariaError
from planaria.plugin.manager import PluginManager
from planaria.protocol import TOKEN_ENV

DEFAULT_PORT = 29400
"""torchrun's port when ``--rdzv-endpoint`` names none."""
BACKENDS = ("c10d", "static", "planaria")
"""``--rdzv-backend`` values accepted: whichever a torchrun line names, planaria's master
forms the rounds."""
RANK_ENVS = ("SLURM_NODEID", "JOB_COMPLETION_INDEX")
"""Where a starter says which node this is (srun; a Kubernetes Indexed Job), when
``--node-rank`` does not: a node id that stays the same when the node is started again."""
TOKEN_HINT = (
    f"set the job's token in every launcher's environment, the same on all nodes, e.g. "
    f"export {TOKEN_ENV}=$(python -c 'import secrets;print(secrets.token_hex(16))') "
    "before srun (which passes it on)"
)


class LauncherError(PlanariaError):
    """A ``--rdzv-endpoint`` line that cannot run."""


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"https://{host}:{self.port}"


def parse_endpoint(text: str) -> Endpoint:
    """``HOST:PORT``, ``HOST`` (port 29400, as torchrun) or ``[V6]:PORT``."""
    text = text.strip()
    match = re.fullmatch(r"\[([0-9a-fA-F:.%\w]+)\](?::(\d+))?|([^:\[\]]+)(?::(\d+))?", text)
    if match is None or not (match.group(1) or match.group(3)):
        raise LauncherError(f"--rdzv-endpoint {text!r}: expected HOST:PORT")
    host = match.group(1) or match.group(3)
    port_text = match.group(2) or match.group(4)
    port = DEFAULT_PORT if port_text is None else int(port_text)
    if not 1 <= port <= 65535:
        raise LauncherError(f"--rdzv-endpoint {text!r}: port {port} is not between 1 and 65535")
    return Endpoint(host, port)


def local_address(host: str) -> str | None:
    """The address of this machine's interfaces that ``host`` names, or None: whether this
    launcher is the endpoint's. An address is this machine's when a socket can be bound to
    it."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise LauncherError(f"--rdzv-endpoint: cannot resolve {host!r}: {exc}") from None
    for family, _, _, _, sockaddr in infos:
        address = str(sockaddr[0])
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((address, 0))
            except OSError as exc:
                if exc.errno == errno.EADDRNOTAVAIL:
                    continue
                raise
            return address
    return None


def node_rank_of(given: int | None) -> int | None:
    """``--node-rank``, else the rank a starter put in the environment, else None."""
    if given is not None:
        return given
    for name in RANK_ENVS:
        value = os.environ.get(name, "")
        if value.isdecimal():
            return int(value)
    return None


def node_id(rank: int | None, address: str) -> str:
    """The node's id: ``node-<rank>`` when the rank is known, else ``node-<address>`` (the
    address this node reaches the master from): the same when the node is started again."""
    if rank is not None:
        return f"node-{rank}"
    with contextlib.suppress(ValueError):
        address = ipaddress.ip_address(address.split("%")[0]).exploded
    return "node-" + re.sub(r"[^A-Za-z0-9.-]", "-", address)


def shared_token() -> str:
    """The job's token, taken out of the environment (nothing this process starts gets it);
    a clear error without one."""
    token = os.environ.pop(TOKEN_ENV, "").strip()
    if not token:
        raise LauncherError(
            f"--rdzv-endpoint needs a shared secret, or any process that reaches the endpoint "
            f"could join the job or pose as its master: {TOKEN_HINT}"
        )
    if len(token) < 16:
        raise LauncherError(f"{TOKEN_ENV} is too short ({len(token)} characters, at least 16)")
    return token


@dataclass(frozen=True)
class Launcher:
    """What this launcher is, from its line and its machine."""

    endpoint: Endpoint
    token: str
    rank: int | None
    here: str | None
    """The address of this machine that the endpoint names, if any."""
    is_master: bool

    @classmethod
    def from_line(
        cls,
        endpoint: str | None,
        backend: str | None,
        node_rank: int | None,
        other: tuple[object, ...] = (),
    ) -> Launcher:
        """``other``: ``--resume``, ``--master-addr``, ``--master-port``, which the endpoint
        excludes. Raises :class:`LauncherError` for a line that cannot run."""
        if endpoint is None:
            raise LauncherError(
                "--node-rank needs --rdzv-endpoint: without it, every node runs here"
            )
        if any(value is not None for value in other):
            raise LauncherError(
                "--rdzv-endpoint names the master's address and port: give no --master-addr, "
                "--master-port or --resume with it"
            )
        if backend is not None and backend not in BACKENDS:
            raise LauncherError(
                f"--rdzv-backend {backend!r}: expected one of {', '.join(BACKENDS)}"
            )
        where = parse_endpoint(endpoint)
        token = shared_token()
        here = local_address(where.host)
        is_master = node_rank == 0 if node_rank is not None else here is not None
        return cls(where, token, node_rank_of(node_rank), here, is_master)

    def settings(self) -> list[str]:
        """The job's fields the line sets (``--set`` overrides): the master on the endpoint
        (over TLS, which the agents' channel binding needs, on loopback too), nodes started
        outside, this node's agent started by the master's launcher."""
        if not self.is_master:
            return ["scheduler.backend=external"]
        address = self.here or "0.0.0.0"
        return [
            f"master.host={address}",
            f"master.port={self.endpoint.port}",
            f"master.advertise={self.endpoint.host}",
            "master.tls=true",
            "scheduler.backend=external",
            f"scheduler.options.here={node_id(self.rank, self.here or self.endpoint.host)}",
            f"scheduler.options.host={os.uname().nodename}",
        ]


def join(launcher: Launcher, file: Path | None, overrides: list[str]) -> int:
    """This launcher is a node's: learn the master's certificate, then run the node's agent
    in this process. The training command is the master's (every launcher is given the same
    line)."""
    endpoint, token, rank = launcher.endpoint, launcher.token, launcher.rank
    from planaria.agent.address import node_address
    from planaria.agent.main import main as agent_main
    from planaria.master.binding import BindingRefused, wait_for_master

    raw = read(file, overrides)
    configure_logging(raw)
    resolved, _ = load_raw(raw, external_plugins(raw))
    timeout = resolved.config.rendezvous.join_timeout
    out.print(f"planaria: joining the job master at {endpoint.url}", highlight=False)

    def waiting(why: str) -> None:
        out.print(
            f"planaria: no master at {endpoint.url} yet ({why}); trying for {timeout:g}s",
            highlight=False,
        )

    try:
        fingerprint = wait_for_master(endpoint.host, endpoint.port, token, timeout, waiting)
    except BindingRefused as exc:
        error(str(exc))
        return EXIT_USAGE
    address = node_address(endpoint.host)
    me = node_id(rank, address)
    log.bind(component="agent")
    host = os.uname().nodename
    return asyncio.run(agent_main(endpoint.url, token, me, host, fingerprint))


def external_plugins(raw: RawConfig) -> PluginManager:
    """The installed plugins, and the built-in ``external`` scheduler even where the
    installed metadata predates it."""
    from planaria.config.loader import disabled_plugins
    from planaria.scheduler import external

    manager = PluginManager.from_entry_points(disable=disabled_plugins(raw))
    if "external" not in manager.plugins:
        manager.register(external, "external")
    return manager
