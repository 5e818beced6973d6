"""Where other nodes reach this one, and the interface that address is on.

The address a node advertises (for torch.distributed's ``MASTER_ADDR`` when it is rank 0, for
the pre-flight collectives, for gloo's pairs) must be one its peers can route to. The host name
is no guide: on many machines it resolves to ``127.0.0.1`` (``/etc/hosts``), and inside a
network namespace or a container it names an address of another network entirely. The local
address of the route towards the master is: the master is reached over the cluster's network,
and so, on any sane network, are the node's peers.

The port it advertises for torch.distributed's store is picked below the kernel's ephemeral
range: a port from that range that is free when picked can be taken as the source port of an
outgoing connection before the store binds it (a Ray node on this machine opens such
connections by the dozen as its workers start), and the workers then fail on ``EADDRINUSE``.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import random
import socket
import struct
from collections.abc import Mapping
from pathlib import Path

from planaria.log import get_logger
from planaria.master.transport import is_loopback

log = get_logger("agent.address")

ADDR_ENV = "PLANARIA_ADDR"
GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"

_SIOCGIFADDR = 0x8915
_IF_INET6 = Path("/proc/net/if_inet6")
_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
STORE_PORTS_LOW = 20000
"""The lowest port picked for torch.distributed's store (Ray's workers bind 10002-19999)."""


def free_port(addr: str) -> int:
    """A port nothing listens at on ``addr`` now, below the ephemeral range where there is
    room for one (see the module's docstring), else one the kernel gives."""
    try:
        ephemeral_low = int(_EPHEMERAL.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    for _ in range(64 if ephemeral_low > STORE_PORTS_LOW else 0):
        port = random.randrange(STORE_PORTS_LOW, ephemeral_low)
        with (
            socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock,
            contextlib.suppress(OSError),
        ):
            sock.bind((addr, port))
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((addr, 0))
        return int(sock.getsockname()[1])


def route_source(host: str, port: int = 9) -> str:
    """The local address the kernel would send from towards ``host``: a UDP socket is
    connected (which only picks the route; no packet is sent) and asked its own address.
    ``OSError`` when there is no route or ``host`` does not resolve."""
    family, kind, proto, _, where = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind, proto) as sock:
        sock.connect(where)
        return str(sock.getsockname()[0])


def node_address(master_host: str, override: str | None = None) -> str:
    """``override`` (``PLANARIA_ADDR``) when given; loopback when the master is on loopback
    (every node is on this machine); else the local address of the route to the master, or,
    where there is none, what this host's name resolves to."""
    if override:
        return override
    if is_loopback(master_host):
        return "127.0.0.1"
    try:
        return route_source(master_host)
    except OSError as exc:
        fallback = socket.gethostbyname(socket.gethostname())
        log.warning(
            "no route to the master to take this node's address from; using the host name's",
            master=master_host,
            address=fallback,
            error=str(exc),
        )
        return fallback


def interface_of(address: str) -> str | None:
    """The name of the network interface that holds ``address``, or None (not an address of
    this machine's interfaces; IPv4: only an interface's primary address is seen)."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return None
    if ip.version == 6:
        return _interface_of_v6(ip.exploded.replace(":", ""))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(reply[20:24]) == address:
                return name
    return None


def _interface_of_v6(hex_address: str) -> str | None:
    try:
        lines = _IF_INET6.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) >= 6 and fields[0] == hex_address:
            return fields[5]
    return None


def gloo_interface(address: str, env: Mapping[str, str]) -> dict[str, str]:
    """``GLOO_SOCKET_IFNAME`` for the workers, unless ``env`` sets it already: the interface
    of ``address`` when that is not loopback. Without it gloo binds what the host name
    resolves to, which need not be ``address``: on ``127.0.0.1`` its peers on other hosts (or
    in other network namespaces) cannot connect back ("Connection refused" in
    connectFullMesh)."""
    if env.get(GLOO_IFNAME_ENV) or is_loopback(address):
        return {}
    name = interface_of(address)
    if name is None:
        log.info("no interface holds this node's address; gloo chooses its own", address=address)
        return {}
    return {GLOO_IFNAME_ENV: name}
