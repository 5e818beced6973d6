"""The address agents are given for the master: never a wildcard.

``master.host: 0.0.0.0`` (or ``::``, or empty) says where the master listens, every interface,
not where it can be reached: handed to an agent on another machine, ``0.0.0.0`` is that agent's
own machine, and it connects to nothing. So when the config binds a wildcard and names no
``master.advertise``, the master works the address out, says which one it chose and why, and
stops the run (a config error, exit 2, naming ``master.advertise``) when it cannot tell:

1. ``PLANARIA_MASTER_ADVERTISE``, what the environment found for it: ``planaria submit``'s
   Slurm batch script sets it on the host where the master runs, at run time, since nobody
   knows that host when the job is submitted;
2. the local address of the route towards the nodes' machines, where the scheduler knows them
   before they start (:meth:`~planaria.scheduler.api.Scheduler.node_addresses`): the address
   the kernel sends from to reach them is, on any sane network, one they reach back (the
   argument of :mod:`planaria.agent.address`, in the other direction). Nodes on this very
   machine are reached on ``127.0.0.1``;
3. the address of the interface of the default route (IPv4), the machine's way out;
4. the machine's name, when it resolves to addresses none of which is loopback (many machines
   map their name to ``127.0.1.1`` in ``/etc/hosts``), and is one a certificate can carry.

The job's certificate names what was chosen (:mod:`planaria.master.tls`).
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import re
import socket
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from planaria.agent.address import route_source
from planaria.errors import PlanariaError

ADVERTISE_ENV = "PLANARIA_MASTER_ADVERTISE"
ROUTES = Path("/proc/net/route")
PROBED = 8
"""At most this many of the nodes' machines are asked for a route (each may need a name
lookup): the first one with a route that leaves this machine answers."""

_SIOCGIFADDR = 0x8915
_RTF_UP = 0x1
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_DNS_NAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*\.?")


class AdvertiseError(PlanariaError):
    """No address could be found that the agents reach the master at."""


@dataclass(frozen=True)
class Advertised:
    address: str
    """An IP address or a host name: what agents connect to."""
    why: str
    """How it was chosen, as the user reads it."""


def is_wildcard(host: str) -> bool:
    """Whether binding ``host`` means every interface: empty, ``0.0.0.0``, ``::``."""
    if not host:
        return True
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def url_host(address: str) -> str:
    """``address`` as the host of a URL: an IPv6 address in brackets."""
    try:
        return f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
    except ValueError:
        return address


def carried_name(value: str) -> bool:
    """Whether ``value`` is an IP address or a DNS name (what a URL and a certificate's
    subject alternative names can hold as they are)."""
    try:
        ipaddress.ip_address(value)
        return True
    except ValueError:
        return len(value) <= 253 and _DNS_NAME.fullmatch(value) is not None


def _leaves_machine(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return not (ip.is_loopback or ip.is_unspecified or ip.is_link_local)


def toward_nodes(
    nodes: Iterable[str], route: Callable[[str], str] = route_source
) -> Advertised | None:
    """The local address of the route to the first of ``nodes`` (addresses or names) that
    leaves this machine; ``127.0.0.1`` when every one that routes stays on it (the nodes run
    here; a node's name that resolves to loopback is this machine's own); None when none
    routes at all."""
    local = None
    for node in list(nodes)[:PROBED]:
        try:
            source = route(node)
        except (OSError, UnicodeError):
            continue
        if _leaves_machine(source):
            return Advertised(source, f"the address this machine reaches the nodes from ({node})")
        local = local or node
    if local is not None:
        return Advertised("127.0.0.1", f"the nodes run on this machine ({local})")
    return None


def default_route_address(routes: Path = ROUTES) -> str | None:
    """The address of the interface of this machine's IPv4 default route (the lowest metric
    one): the source the kernel picks towards its gateway, or, for a route with no gateway,
    the interface's own. None when there is no default route."""
    try:
        lines = routes.read_text().splitlines()[1:]
    except OSError:
        return None
    found = []
    for line in lines:
        fields = line.split()
        try:
            name, destination, gateway, flags = fields[0], fields[1], fields[2], fields[3]
            metric, mask = int(fields[6]), fields[7]
            if int(destination, 16) or int(mask, 16) or not int(flags, 16) & _RTF_UP:
                continue
            found.append((metric, name, socket.inet_ntoa(struct.pack("<I", int(gateway, 16)))))
        except (IndexError, ValueError, struct.error):
            continue
    for _, name, gateway in sorted(found):
        with contextlib.suppress(OSError):
            address = route_source(gateway) if gateway != "0.0.0.0" else _interface_address(name)
            if address and _leaves_machine(address):
                return address
    return None


def _interface_address(name: str) -> str | None:
    """The primary IPv4 address of interface ``name``."""
    request = struct.pack("256s", name.encode()[:15])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
        except OSError:
            return None
    return socket.inet_ntoa(reply[20:24])


def routable_name(name: str) -> str | None:
    """``name`` (this machine's) when a certificate can carry it and it resolves to addresses
    of which none is loopback; else None."""
    if not name or not carried_name(name):
        return None
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
        addresses = {ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos}
    except (OSError, UnicodeError, ValueError):
        return None
    if not addresses or any(a.is_loopback or a.is_unspecified for a in addresses):
        return None
    return name


@dataclass(frozen=True)
class Probes:
    """Where :func:`choose` looks; a test swaps one for a machine it cannot be on."""

    toward_nodes: Callable[[list[str]], Advertised | None] = toward_nodes
    default_route: Callable[[], str | None] = default_route_address
    hostname: Callable[[], str] = socket.gethostname
    routable_name: Callable[[str], str | None] = routable_name


def find(nodes: Callable[[], list[str]], probes: Probes = Probes()) -> Advertised:
    """The address of this machine that the nodes reach, for a master bound to every
    interface (steps 2 to 4 of the module docstring); ``nodes`` gives where the scheduler's
    nodes will run. Raises :class:`AdvertiseError` saying what was tried."""
    hosts = nodes()
    chosen = probes.toward_nodes(hosts) if hosts else None
    if chosen is not None:
        return chosen
    address = probes.default_route()
    if address is not None:
        return Advertised(address, "the address of this machine's default route")
    name = probes.hostname()
    if probes.routable_name(name) is not None:
        return Advertised(name, "this machine's name, which resolves to no loopback address")
    tried = (
        f"no route to the nodes' machines ({', '.join(hosts[:PROBED])})"
        if hosts
        else "the scheduler does not know the nodes' machines before they start"
    )
    raise AdvertiseError(
        f"no address of this machine was found that agents can reach: {tried}, there is no "
        f"default route, and this machine's name {name!r} resolves to a loopback address or "
        "not at all"
    )


def choose(
    host: str,
    advertise: str | None,
    *,
    env: Mapping[str, str],
    nodes: Callable[[], list[str]],
    probes: Probes = Probes(),
) -> Advertised:
    """What agents are told for a master bound to ``host`` (``master.host``) with
    ``advertise`` (``master.advertise``); ``env`` is the master's environment, ``nodes``
    gives where the scheduler's nodes will run (asked only when it matters). See the module
    docstring for the order. Raises :class:`AdvertiseError` when nothing is found."""
    if advertise:
        return Advertised(advertise, "master.advertise")
    if not is_wildcard(host):
        return Advertised(host, "master.host")
    found = env.get(ADVERTISE_ENV, "").strip()
    if found:
        if not carried_name(found):
            raise AdvertiseError(
                f"{ADVERTISE_ENV}={found!r} is neither an IP address nor a host name: unset it, "
                "or set master.advertise to the address agents reach this machine at"
            )
        return Advertised(found, f"{ADVERTISE_ENV}, as the environment found it")
    try:
        return find(nodes, probes)
    except AdvertiseError as exc:
        raise AdvertiseError(
            f"master.host is {host!r} (every interface) and master.advertise is not set, and "
            f"{exc}. Set master.advertise to the address or name of this machine that the "
            "nodes reach"
        ) from None
